"""The remote reward client's URL rules and its retries (lit_rlvr/rewards/remote.py over lit_rlvr/run/http.py),
against an in-process HTTP server on 127.0.0.1: only http(s) URLs with a host and a valid port pass; the start check
contacts the port the URL means (80, 443 or the given one); a refused start check is one line naming the key and the
URL; a URL without a path gets /get_reward; 5xx answers and refused connections are retried with doubling back-off,
a 4xx is not; an answer that is not one number per completion makes that chunk malformed; chunks of `batch_size`.
(Redirects, size bounds, deadlines and credentials: tests/test_http_clients.py; the runner end to end:
tests/test_rewards_remote.py.)"""

from __future__ import annotations

import json
import socket
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import urllib3.util.connection

from lit_rlvr.config.errors import RewardOptionError, StopRequested
from lit_rlvr.rewards.remote import PROBE, RemoteReward, endpoint
from lit_rlvr.run import http
from lit_rlvr.run.http import url_problem
from lit_rlvr.run.stop import STOP

KEY, EXAMPLE = "reward.options.url", "http://127.0.0.1:5000/get_reward"


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    """requests honours *_PROXY: the tests' requests go straight to 127.0.0.1 (or the patched connect)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def sleeps(monkeypatch):
    """The client's back-off sleeps, recorded instead of slept (only http.py's own `time`: servers sleep for real)."""
    slept: list = []
    monkeypatch.setattr(http, "time", types.SimpleNamespace(sleep=slept.append, monotonic=time.monotonic))
    return slept


def free_port() -> int:
    """A port on 127.0.0.1 that nobody listens on (a connection to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the URL rules (no network) -------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "file:///etc/passwd", "gopher://h:70/", "http://", "https:///x",
                                 "http://127.0.0.1:99999/", "http://h:65536/", "http://h:port/", "127.0.0.1:5000",
                                 "", None, 5])
def test_urls_that_are_not_http_with_a_host_are_refused(url):
    line = url_problem(url, KEY, EXAMPLE)
    assert line is not None and line.startswith(f"{KEY}={url!r} is not valid"), line
    assert "\n" not in line and EXAMPLE in line
    with pytest.raises(RewardOptionError) as err:
        RemoteReward(url)
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(f"{KEY}={url!r}")
    assert RemoteReward.check_options({"url": url}) == [line]  # refused before any request


def test_an_unset_url_is_refused():
    assert url_problem("???", KEY, EXAMPLE).startswith(f"{KEY}=??? is not valid")


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "https://example.invalid/score", "http://h/", "HTTP://h:8/",
                                 "http://h:65535/x"])
def test_http_and_https_urls_with_a_host_pass_without_any_request(url):
    assert url_problem(url, KEY, EXAMPLE) is None
    RemoteReward(url).close()  # building the client sends nothing: only check_options does


@pytest.mark.parametrize("url, expected", [("http://h:1", "http://h:1/get_reward"),
                                           ("http://h:1/", "http://h:1/get_reward"),
                                           ("http://h:1/score", "http://h:1/score"),
                                           ("https://h/a/b?x=1", "https://h/a/b?x=1")])
def test_a_url_without_a_path_gets_get_reward(url, expected):
    assert endpoint(url) == expected
    reward = RemoteReward(url)
    assert reward.url == expected
    reward.close()


# -- a server on 127.0.0.1 -------------------------------------------------------------------------------------


class Server:
    """Answers each POST from a script of (status, body) and records (path, decoded body); the last entry repeats.
    A callable body is called with the request's body; bytes are sent as they are, anything else as JSON."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        owner, lock = self, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    owner.requests.append((self.path, sent))
                    status, body = owner.script.pop(0) if len(owner.script) > 1 else owner.script[0]
                if callable(body):
                    body = body(sent)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"

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


def ones(body):
    return {"rewards": [1.0] * len(body["query"])}


def score_one(url, **options):
    reward = RemoteReward(url, **options)
    try:
        (result,) = reward.score_batch(["p"], ["c"], [0])
    finally:
        reward.close()
    return result


# -- the start check -------------------------------------------------------------------------------------------


def test_the_start_check_sends_one_request_of_the_runs_kind_to_the_given_port(serve):
    server = serve([(200, ones)])
    assert RemoteReward.check_options({"url": server.url}) == []
    full = {k: v * 64 for k, v in PROBE.items()}  # a whole chunk of the default batch_size
    assert server.requests == [("/get_reward", full)]
    assert RemoteReward.check_options({"url": server.url + "/score", "batch_size": 3}) == []
    assert server.requests[1] == ("/score", {k: v * 3 for k, v in PROBE.items()})


@pytest.mark.parametrize("answer", [{"rewards": [1.0, 2.0]}, {"rewards": []}, {"rewards": 1.0}, {"scores": [1.0]},
                                    [1.0]])
def test_a_start_check_answered_with_other_than_one_score_is_refused(serve, answer):
    server = serve([(200, answer)])
    (line,) = RemoteReward.check_options({"url": server.url})
    assert line.startswith(f"{KEY}={server.url!r}: the start check's request was answered "), line


@pytest.mark.parametrize("url, port", [("http://h.example/x", 80), ("https://h.example/x", 443),
                                       ("http://h.example:8123", 8123), ("https://h.example:80/", 80),
                                       ("http://h.example:443/", 443)])
def test_the_start_check_contacts_the_port_the_url_means(serve, monkeypatch, url, port):
    """The connect of urllib3 (under requests) is sent to the test's server, recording the address it was asked."""
    server, asked = serve([(200, ones)]), []

    def connect(address, *args, **kwargs):
        asked.append(address)
        return socket.create_connection(("127.0.0.1", server.port), 5.0)

    monkeypatch.setattr(urllib3.util.connection, "create_connection", connect)
    problems = RemoteReward.check_options({"url": url, "retries": 0})
    assert asked == [("h.example", port)]
    if url.startswith("http://"):  # the plain server answered the start check
        assert problems == [] and len(server.requests) == 1
    else:  # https:// to the plain server: the TLS handshake fails, after the connect to the port
        assert len(problems) == 1 and "TLS handshake failed" in problems[0]


@pytest.mark.parametrize("path", ["", "/get_reward"])
def test_a_refused_start_check_is_one_line_naming_the_key_and_the_url(sleeps, path):
    url = f"http://127.0.0.1:{free_port()}{path}"
    (line,) = RemoteReward.check_options({"url": url, "retries": 1, "backoff_s": 0.25})
    assert line.startswith(f"{KEY}={url!r}: the server cannot be reached ("), line  # the URL as given
    assert "\n" not in line and "start it first" in line
    assert sleeps == [0.25]  # the start check's request is retried as the run's are


def test_check_options_before_any_work(serve):
    assert RemoteReward.check_options({})[0].startswith("reward=remote needs reward.options.url")
    server = serve([(200, ones)])
    # runner keys (isolation, timeout of the runner) are not the client's: left out of its check
    assert RemoteReward.check_options({"url": server.url, "isolation": "thread", "timeout_s": 5}) == []
    (line,) = RemoteReward.check_options({"url": server.url, "batch_size": 0})
    assert line.startswith("reward.options.batch_size=0")
    assert len(server.requests) == 1  # a bad setting: no request


# -- retries ----------------------------------------------------------------------------------------------------


def test_5xx_is_retried_with_doubling_back_off(serve, sleeps):
    server = serve([(503, {}), (500, {}), (200, ones)])
    reward = RemoteReward(server.url, retries=2, backoff_s=0.25)
    try:
        assert reward.score_batch(["p"], ["c"], [0]) == [1.0]
    finally:
        reward.close()
    assert len(server.requests) == 3 and sleeps == [0.25, 0.5]
    failing = serve([(500, {})])
    result = score_one(failing.url, retries=1, backoff_s=0.0)
    assert result.malformed and "HTTP 500" in result.info
    assert len(failing.requests) == 2  # one try and one retry


@pytest.mark.parametrize("status", [404, 499])
def test_a_4xx_is_not_retried(serve, sleeps, status):
    server = serve([(status, {}), (200, ones)])
    result = score_one(server.url, retries=3, backoff_s=0.0)
    assert result.malformed and f"HTTP {status}" in result.info
    assert len(server.requests) == 1 and sleeps == []


def test_a_refused_connection_is_retried_with_doubling_back_off(sleeps):
    url = f"http://127.0.0.1:{free_port()}/"
    result = score_one(url, retries=2, backoff_s=1.0)
    assert result.malformed and result.info.startswith("error: reward server")
    assert sleeps == [1.0, 2.0]


# -- chunks and answers -----------------------------------------------------------------------------------------


def test_chunks_of_batch_size_with_the_openrlhf_body(serve):
    server = serve([(200, lambda body: {"rewards": [float(len(q)) for q in body["query"]]})])
    reward = RemoteReward(server.url, batch_size=2, max_concurrent=3)
    try:
        prompts = ["a", [{"content": "b"}, {"content": "c"}], "d", 7, "e"]
        scores = reward.score_batch(prompts, ["x", "yy", "zzz", "w", ""], [1, 2, 3, 4, 5])
    finally:
        reward.close()
    assert scores == [2.0, 4.0, 4.0, 2.0, 1.0]  # len(prompt text + completion), in the batch's order
    assert {path for path, _ in server.requests} == {"/get_reward"}
    bodies = sorted((body for _, body in server.requests), key=lambda body: body["labels"])  # chunks run at once
    assert bodies == [{"query": ["ax", "bcyy"], "prompts": ["a", [{"content": "b"}, {"content": "c"}]],
                       "labels": [1, 2]},
                      {"query": ["dzzz", "7w"], "prompts": ["d", 7], "labels": [3, 4]},
                      {"query": ["e"], "prompts": ["e"], "labels": [5]}]


@pytest.mark.parametrize("answer", [{"rewards": [1.0]}, {"rewards": [1.0, 2.0, 3.0]}, {"scores": [1.0, 2.0]},
                                    [1.0, 2.0], {"rewards": "12"}, b"not json"])
def test_an_answer_that_is_not_one_number_per_completion_is_malformed(serve, answer):
    server = serve([(200, lambda body: ones(body) if len(body["query"]) == 1 else answer)])
    reward = RemoteReward(server.url, batch_size=2, retries=0)
    try:
        results = reward.score_batch(["p", "q", "r"], ["a", "b", "c"], [0, 0, 0])
    finally:
        reward.close()
    assert len(results) == 3 and results[2] == 1.0  # only the bad chunk's completions
    assert all(r.malformed and r.score == -1.0 and r.info.startswith("error: reward server") for r in results[:2])


def test_another_score_key(serve):
    server = serve([(200, lambda body: {"scores": [0.5, 0.25][:len(body["query"])]})])
    reward = RemoteReward(server.url, score_key="scores")
    try:
        assert reward.score_batch(["p", "q"], ["a", "b"], [0, 0]) == [0.5, 0.25]
        assert reward("p", "a", 0) == 0.5
    finally:
        reward.close()


@pytest.mark.parametrize("length, shortened", [(120, False), (121, True)])
def test_a_bad_answer_is_quoted_up_to_120_characters(serve, length, shortened):
    answer = {"x": "a" * (length - 9)}  # repr: {'x': '...'} is `length` characters
    assert len(repr(answer)) == length
    server = serve([(200, answer)])
    result = score_one(server.url, retries=0)
    assert result.score == -1.0 and result.malformed  # the failure score
    assert (repr(answer) in result.info) is not shortened
    assert (repr(answer)[:100] + "..." in result.info) is shortened


# -- options and defaults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, good, bad", [("batch_size", 1, 0), ("max_concurrent", 1, 0), ("timeout_s", 0.01, 0),
                                            ("retries", 0, -1), ("backoff_s", 0.0, -0.01), ("score_key", "s", ""),
                                            ("max_response_bytes", 1, 0)])
def test_client_options_at_their_bounds(key, good, bad):
    RemoteReward("http://127.0.0.1:1", **{key: good}).close()
    with pytest.raises(RewardOptionError, match=rf"reward\.options\.{key}="):
        RemoteReward("http://127.0.0.1:1", **{key: bad})


def test_the_clients_defaults(serve, sleeps):
    """64 completions a request, 3 retries of a 5xx from 0.5 s doubling, 30 s a request, the `rewards` key."""
    server = serve([(200, ones)])
    reward = RemoteReward(server.url)
    try:
        assert reward.score_batch(["p"] * 65, ["c"] * 65, [0] * 65) == [1.0] * 65
    finally:
        reward.close()
    assert sorted(len(body["query"]) for _, body in server.requests) == [1, 64]
    assert reward.timeout_s == reward.client.timeout_s == 30.0 and reward.score_key == "rewards"
    assert reward.client.max_response_bytes == http.DEFAULT_MAX_RESPONSE_BYTES
    failing = serve([(503, {})])
    result = score_one(failing.url)
    assert result.malformed and len(failing.requests) == 4 and sleeps == [0.5, 1.0, 2.0]


def test_at_most_four_requests_in_flight_by_default(serve):
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def slow(body):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.4)
        with lock:
            state["now"] -= 1
        return ones(body)

    server = serve([(200, slow)])
    reward = RemoteReward(server.url, batch_size=1)
    try:
        assert reward.score_batch(["p"] * 6, ["c"] * 6, [0] * 6) == [1.0] * 6
    finally:
        reward.close()
    assert state["most"] == 4


def test_close_cancels_the_queued_chunks_without_waiting(serve):
    def slow(body):
        time.sleep(0.8)
        return ones(body)

    server = serve([(200, slow)])
    reward = RemoteReward(server.url, batch_size=1, max_concurrent=1, retries=0)
    outcome = []

    def score():
        try:
            outcome.append(reward.score_batch(["p"] * 3, ["c"] * 3, [0] * 3))
        except BaseException as err:  # noqa: BLE001 - the cancelled chunks' futures raise
            outcome.append(type(err).__name__)

    thread = threading.Thread(target=score, daemon=True)  # daemon: a hung call must not hold pytest's exit
    thread.start()
    deadline = time.monotonic() + 30
    while not server.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    reward.close()
    assert time.monotonic() - started < 0.5  # no wait for the request in flight
    thread.join(3)
    time.sleep(0.2)  # past the request in flight (0.8 s): a queued chunk would have been sent by now
    assert len(server.requests) == 1  # the two queued never sent
    assert outcome == ["CancelledError"]  # the two queued never sent
    reward.close()  # closing again (no pool): nothing to do
    assert RemoteReward(server.url).close() is None  # never used: no pool


def test_a_stop_past_its_grace_sends_none_of_the_queued_chunks():
    """A stop request ends the wait on the chunk in flight, and the chunks queued behind it are never sent."""
    def slow(body):
        time.sleep(1.5)
        return ones(body)

    server = Server([(200, slow)])
    reward = RemoteReward(server.url, batch_size=1, max_concurrent=1, retries=0)
    STOP.arm(0.2)
    timer = threading.Timer(0.3, STOP.request, ("SIGTERM",))
    try:
        timer.start()
        with pytest.raises(StopRequested):
            reward.score_batch(["p"] * 3, ["c"] * 3, [0] * 3)
        time.sleep(2.5)  # past the request in flight: a queued chunk would have been sent by now
        assert len(server.requests) == 1
    finally:
        timer.cancel()
        STOP.arm(None)
        reward.close()
        server.close()
