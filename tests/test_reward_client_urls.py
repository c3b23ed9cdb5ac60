"""The remote reward client's URL rules and its retries, against an in-process HTTP server on 127.0.0.1: only
http(s) URLs with a host and a valid port pass; the start probe opens the port the URL means (80, 443 or the
given one); a URL without a path gets /get_reward; 5xx answers and refused connections are retried with doubling
back-off, a 4xx is not; an answer that is not one number per completion makes that chunk malformed; chunks of
`batch_size` in order."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.rewards import remote
from lit_rlvr.rewards.remote import RemoteReward, endpoint, post_json, url_problem


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "file:///etc/passwd", "gopher://h:70/", "http://", "https:///x",
                                 "http://127.0.0.1:99999/", "http://h:port/", "127.0.0.1:5000", "", None, 5])
def test_urls_that_are_not_http_with_a_host_are_refused(url):
    line = url_problem(url, probe=False)
    assert line is not None and line.startswith(f"reward.options.url={url!r}"), line
    with pytest.raises(RewardOptionError):
        RemoteReward(url, probe=False)


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "https://example.invalid/score", "http://h/", "HTTP://h:8/"])
def test_http_and_https_urls_pass_without_a_probe(url):
    assert url_problem(url, probe=False) is None


@pytest.mark.parametrize("url, port", [("http://h.example/x", 80), ("https://h.example/x", 443),
                                       ("http://h.example:8123", 8123), ("https://h.example:80/", 80)])
def test_the_probe_opens_the_port_the_url_means(monkeypatch, url, port):
    opened = []

    class Connection:
        def close(self):
            opened.append("closed")

    def connect(address, timeout):
        opened.append((address, timeout))
        return Connection()

    monkeypatch.setattr(remote.socket, "create_connection", connect)
    assert url_problem(url, key="judge.url") is None
    assert opened == [(("h.example", port), 5.0), "closed"]


def test_a_refused_probe_is_one_line_naming_the_key_and_url(monkeypatch):
    def refuse(address, timeout):
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(remote.socket, "create_connection", refuse)
    line = url_problem("http://h.example:1/x", key="k")
    assert line.startswith("k='http://h.example:1/x': the server cannot be reached (ConnectionRefusedError")


@pytest.mark.parametrize("url, expected", [("http://h:1", "http://h:1/get_reward"),
                                           ("http://h:1/", "http://h:1/get_reward"),
                                           ("http://h:1/score", "http://h:1/score"),
                                           ("https://h/a/b?x=1", "https://h/a/b?x=1")])
def test_a_url_without_a_path_gets_get_reward(url, expected):
    assert endpoint(url) == expected


class Server:
    """Answers each POST from a script of (status, body) and records the bodies; the last entry repeats."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                owner.requests.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                status, body = owner.script.pop(0) if len(owner.script) > 1 else owner.script[0]
                if callable(body):
                    body = body(owner.requests[-1][1])
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(script):
        servers.append(Server(script))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_5xx_is_retried_with_doubling_back_off_and_4xx_is_not(serve, monkeypatch):
    sleeps = []
    monkeypatch.setattr(remote.time, "sleep", sleeps.append)
    server = serve([(503, {}), (500, {}), (200, {"rewards": [1.0]})])
    assert post_json(server.url + "/get_reward", b"{}", 5.0, 2, 0.25) == {"rewards": [1.0]}
    assert len(server.requests) == 3 and sleeps == [0.25, 0.5]
    failing = serve([(500, {})])
    with pytest.raises(remote.urllib.error.HTTPError):
        post_json(failing.url, b"{}", 5.0, 1, 0.0)
    assert len(failing.requests) == 2  # one try and one retry
    missing = serve([(404, {}), (200, {"rewards": [1.0]})])
    with pytest.raises(remote.urllib.error.HTTPError):
        post_json(missing.url, b"{}", 5.0, 3, 0.0)
    assert len(missing.requests) == 1
    ok = serve([(499, {}), (200, {})])
    with pytest.raises(remote.urllib.error.HTTPError):
        post_json(ok.url, b"{}", 5.0, 3, 0.0)


def test_a_refused_connection_is_retried(monkeypatch):
    import socket

    sleeps = []
    monkeypatch.setattr(remote.time, "sleep", sleeps.append)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    with pytest.raises(remote.urllib.error.URLError):
        post_json(url, b"{}", 2.0, 2, 1.0)
    assert sleeps == [1.0, 2.0]


def test_chunks_of_batch_size_in_order_with_the_openrlhf_body(serve):
    server = serve([(200, lambda body: {"rewards": [float(len(q)) for q in body["query"]]})])
    reward = RemoteReward(server.url, batch_size=2, max_concurrent=1, probe=False)
    try:
        prompts = ["a", [{"content": "b"}, {"content": "c"}], "d", 7, "e"]
        scores = reward.score_batch(prompts, ["x", "yy", "zzz", "w", ""], [1, 2, 3, 4, 5])
    finally:
        reward.close()
    assert scores == [2.0, 4.0, 4.0, 2.0, 1.0]  # len(prompt text + completion)
    assert [len(body["query"]) for _, body in server.requests] == [2, 2, 1]
    assert {path for path, _ in server.requests} == {"/get_reward"}
    first = server.requests[0][1]
    assert first == {"query": ["ax", "bcyy"], "prompts": ["a", [{"content": "b"}, {"content": "c"}]],
                     "labels": [1, 2]}


@pytest.mark.parametrize("answer", [{"rewards": [1.0]}, {"rewards": [1.0, 2.0, 3.0]}, {"scores": [1.0, 2.0]},
                                    [1.0, 2.0], {"rewards": "12"}])
def test_an_answer_that_is_not_one_number_per_completion_is_malformed(serve, answer):
    server = serve([(200, answer)])
    reward = RemoteReward(server.url, batch_size=8, probe=False, retries=0)
    try:
        results = reward.score_batch(["p", "q"], ["a", "b"], [0, 0])
    finally:
        reward.close()
    assert len(results) == 2 and all(r.malformed and r.info.startswith("error: reward server") for r in results)


def test_another_score_key(serve):
    server = serve([(200, lambda body: {"scores": [0.5, 0.25][:len(body["query"])]})])
    reward = RemoteReward(server.url, score_key="scores", probe=False)
    try:
        assert reward.score_batch(["p", "q"], ["a", "b"], [0, 0]) == [0.5, 0.25]
        assert reward("p", "a", 0) == 0.5
    finally:
        reward.close()


@pytest.mark.parametrize("key, good, bad", [("batch_size", 1, 0), ("max_concurrent", 1, 0), ("timeout_s", 0.01, 0),
                                            ("retries", 0, -1), ("backoff_s", 0.0, -0.01), ("score_key", "s", "")])
def test_client_options_at_their_bounds(key, good, bad):
    RemoteReward("http://127.0.0.1:1", probe=False, **{key: good})
    with pytest.raises(RewardOptionError, match=rf"reward\.options\.{key}="):
        RemoteReward("http://127.0.0.1:1", probe=False, **{key: bad})


def test_the_clients_defaults(serve, monkeypatch):
    """64 completions a request, 3 retries of a 5xx from 0.5 s doubling, 30 s a request, the `rewards` key."""
    sleeps, timeouts = [], []
    monkeypatch.setattr(remote.time, "sleep", sleeps.append)
    urlopen = remote.urllib.request.urlopen
    monkeypatch.setattr(remote.urllib.request, "urlopen",
                        lambda request, timeout: timeouts.append(timeout) or urlopen(request, timeout=timeout))
    server = serve([(200, lambda body: {"rewards": [1.0] * len(body["query"])})])
    reward = RemoteReward(server.url, probe=False)
    try:
        assert reward.score_batch(["p"] * 65, ["c"] * 65, [0] * 65) == [1.0] * 65
    finally:
        reward.close()
    assert sorted(len(body["query"]) for _, body in server.requests) == [1, 64] and set(timeouts) == {30.0}
    failing = serve([(503, {})])
    reward = RemoteReward(failing.url, probe=False)
    try:
        (result,) = reward.score_batch(["p"], ["c"], [0])
    finally:
        reward.close()
    assert result.malformed and len(failing.requests) == 4 and sleeps == [0.5, 1.0, 2.0]


def test_at_most_four_requests_in_flight_by_default():
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def slow(body):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.5)
        with lock:
            state["now"] -= 1
        return {"rewards": [1.0] * len(body["query"])}

    server = Server([(200, slow)])
    reward = RemoteReward(server.url, batch_size=1, probe=False)
    try:
        assert reward.score_batch(["p"] * 6, ["c"] * 6, [0] * 6) == [1.0] * 6
    finally:
        reward.close()
        server.close()
    assert state["most"] == 4


def test_the_client_probes_its_server_by_default():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/get_reward"
    with pytest.raises(RewardOptionError, match="the server cannot be reached"):
        RemoteReward(url)


@pytest.mark.parametrize("length, shortened", [(120, False), (121, True)])
def test_a_bad_answer_is_quoted_up_to_120_characters(serve, length, shortened):
    answer = {"x": "a" * (length - 9)}  # repr: {'x': '...'} is `length` characters
    assert len(repr(answer)) == length
    server = serve([(200, answer)])
    reward = RemoteReward(server.url, probe=False, retries=0)
    try:
        (result,) = reward.score_batch(["p"], ["c"], [0])
    finally:
        reward.close()
    assert result.score == -1.0 and result.malformed  # the failure score
    assert (repr(answer) in result.info) is not shortened
    assert (repr(answer)[:100] + "..." in result.info) is shortened


def test_close_cancels_the_queued_chunks_without_waiting():
    def slow(body):
        time.sleep(0.8)
        return {"rewards": [1.0] * len(body["query"])}

    server = Server([(200, slow)])
    reward = RemoteReward(server.url, batch_size=1, max_concurrent=1, probe=False, retries=0)
    outcome = []

    def score():
        try:
            outcome.append(reward.score_batch(["p"] * 3, ["c"] * 3, [0] * 3))
        except BaseException as err:  # noqa: BLE001 - the cancelled chunks' futures raise
            outcome.append(type(err).__name__)

    thread = threading.Thread(target=score)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        reward.close()
        assert time.monotonic() - started < 0.5  # no wait for the request in flight
        thread.join(30)
        time.sleep(1.0)
        assert len(server.requests) == 1 and outcome == ["CancelledError"]  # the two queued never sent
        reward.close()  # closing again (no pool): nothing to do
        assert RemoteReward(server.url, probe=False).close() is None  # never used: no pool
    finally:
        server.close()


def test_check_options_before_any_work():
    assert RemoteReward.check_options({})[0].startswith("reward=remote needs reward.options.url")
    # runner keys (isolation, timeout of the runner) are not the client's: left out of its check
    assert RemoteReward.check_options({"url": "http://127.0.0.1:1", "probe": False, "isolation": "thread"}) == []
    (line,) = RemoteReward.check_options({"url": "http://127.0.0.1:1", "probe": False, "batch_size": 0})
    assert line.startswith("reward.options.batch_size=0")
    (line,) = RemoteReward.check_options({"url": "ftp://h/x", "probe": False})
    assert line.startswith("reward.options.url='ftp://h/x'")
