"""Every HTTP client of lit-rlvr (the reward server, the LLM judge, the code sandbox by URL: lit_rlvr/run/http.py)
against real servers of the test's own on 127.0.0.1 (the standard library's http.server in a thread) that misbehave
as a hostile or broken server would (issue 61): redirects to another host and to ftp://, answers too large to hold,
answers trickled a byte at a time, refused credentials, https:// to a plain server; and the API key's way in (the
environment or a file) and out (never a file of the run, never a log)."""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch  # noqa: F401  (the runners build tensors: loaded before a clock starts)

from lit_rlvr.config.errors import ConfigError, HTTPRefusal
from lit_rlvr.config.problems import secret_problems
from lit_rlvr.config.settings import RewardConfig
from lit_rlvr.module import GRPOModule
from lit_rlvr.rewards import build_reward_runner, reward_problems
from lit_rlvr.run.http import HTTPClient, redact

REPO = Path(__file__).resolve().parents[1]
PROMPTS, ANSWERS = ["1+1=", "2+2=", "3+3=", "4+4="], [2, 4, 6, 8]
MB = 1 << 20


class Server:
    """A server on 127.0.0.1 whose handler calls `respond(handler, body)` for every request (any method); `hits`
    records (method, path, headers, body); `sent` counts the bytes `respond` wrote through `write`."""

    def __init__(self, respond):
        self.hits, self.sent, outer = [], [0], self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.hits.append((self.command, self.path, self.headers, body))  # case-insensitive
                try:
                    respond(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            do_GET = do_POST = _any  # noqa: N815

            def write(self, data: bytes) -> None:
                self.wfile.write(data)
                self.wfile.flush()
                outer.sent[0] += len(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.block_on_close = False
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def serve():
    servers = []

    def start(respond):
        servers.append(Server(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def send_json(handler, answer, status=200):
    data = json.dumps(answer).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.write(data)


def redirect(status, location):
    def respond(handler, body):
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return respond


def scores(value):
    """A reward server that answers `value` for every completion."""
    return lambda handler, body: send_json(handler, {"rewards": [value] * len(json.loads(body or b"{}").get(
        "query", [0]))})


def remote(url, **options):
    return build_reward_runner("remote", {"url": url, "batch_size": 4, "timeout_s": 5, "retries": 0, **options})


# -- class 2: no redirect followed, no scheme but http(s) --------------------------------------------------------


def test_a_302_to_another_host_is_refused_and_the_other_host_never_asked(serve, caplog):
    other = serve(scores(1.0))  # it would score every wrong answer below +1
    first = serve(redirect(302, other.url + "/get_reward"))
    runner = remote(first.url)
    with caplog.at_level(logging.WARNING):
        batch = runner(PROMPTS, ["5", "5", "5", "5"], ANSWERS)
    runner.close()
    assert batch.failures == 4 and batch.malformed.all() and (batch.scores == -1).all()
    assert other.hits == [] and len(first.hits) == 1
    assert f"answered HTTP 302, a redirect to {other.url}/get_reward: lit-rlvr follows no redirects" in caplog.text
    problems = reward_problems("remote", {"url": first.url})  # the start check refuses it before any work
    assert len(problems) == 1 and problems[0].startswith(f"reward.options.url={first.url!r}: the start check's")
    assert "HTTP 302" in problems[0] and other.hits == []


def test_a_redirect_to_ftp_opens_no_ftp_session(serve, caplog):
    with socket.socket() as ftp:
        ftp.bind(("127.0.0.1", 0))
        ftp.listen(1)
        ftp.settimeout(0.2)
        first = serve(redirect(302, f"ftp://127.0.0.1:{ftp.getsockname()[1]}/rewards.json"))
        runner = remote(first.url, timeout_s=2)
        with caplog.at_level(logging.WARNING):
            batch = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)
        runner.close()
        assert batch.failures == 4 and "/rewards.json: lit-rlvr follows no redirects" in caplog.text
        with pytest.raises(HTTPRefusal, match="follows no redirects") as err:
            HTTPClient(timeout_s=2).post_json(first.url + "/get_reward", {"query": []})
        assert err.value.kind == "redirect" and err.value.status == 302
        with pytest.raises(socket.timeout):
            ftp.accept()  # nobody connected
    assert "lit-rlvr speaks no other scheme" in reward_problems("remote", {"url": "ftp://127.0.0.1/x"})[0]
    with pytest.raises(HTTPRefusal, match="http:// and https:// only"):
        HTTPClient(timeout_s=2).post("ftp://127.0.0.1/x", b"{}")


def test_the_sandbox_client_follows_no_redirect(serve):
    from lit_rlvr.rewards.code import Limits
    from lit_rlvr.rewards.sandbox.remote import run_remote

    other = serve(lambda h, b: send_json(h, {"status": "Success", "run_result": {
        "status": "Finished", "return_code": 0, "stdout": "3\n", "stderr": ""}}))
    first = serve(redirect(307, other.url + "/run_code"))
    status, _, stderr, _, _ = run_remote(first.url + "/run_code", "print(3)", limits=Limits(timeout_s=1), retries=0)
    assert status == "sandbox_error" and "HTTP 307, a redirect to" in stderr and other.hits == []
    problems = reward_problems("code", {"sandbox_url": first.url})
    assert len(problems) == 1 and "follows no redirects" in problems[0] and other.hits == []


# -- class 3: a bounded answer, one deadline per request --------------------------------------------------------


def _lazy_body(total, declare):
    """Answers `total` bytes of a JSON list in 64 KiB writes, generated as they go; `declare`: with Content-Length
    (else the body ends with the connection)."""
    def respond(handler, body):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if declare:
            handler.send_header("Content-Length", str(total))
        else:
            handler.send_header("Connection", "close")
            handler.close_connection = True
        handler.end_headers()
        handler.write(b'{"rewards": [')
        piece = b"1.0, " * (65536 // 5)
        for _ in range(total // len(piece)):
            handler.write(piece)
    return respond


@pytest.mark.parametrize("declare", [True, False])
def test_an_answer_over_the_bound_is_refused_without_reading_it(serve, caplog, declare):
    server = serve(_lazy_body(50 * MB, declare))
    runner = remote(server.url, max_response_bytes=MB)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        batch = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)
    runner.close()
    assert batch.failures == 4 and batch.malformed.all()
    assert f"answered more than {MB} bytes (reward.options.max_response_bytes={MB})" in caplog.text
    time.sleep(0.3)  # the server's writes end once the client has hung up
    assert server.sent[0] < 16 * MB and time.monotonic() - start < 10  # not the 50 MB (socket buffers aside)


def test_max_response_bytes_is_checked_before_any_work():
    problems = reward_problems("remote", {"url": "http://127.0.0.1:1", "max_response_bytes": 0})
    assert problems == ["reward.options.max_response_bytes=0 is not valid: expected an integer >= 1 (bytes of one "
                        "answer)"]


def _trickle(where):
    """One byte every 0.4 s, of the status line and headers ("headers") or of a 40-byte body ("body")."""
    def respond(handler, body):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
        data = head + b'{"rewards": [1.0, 1.0, 1.0, 1.0]}      '
        if where == "body":
            handler.write(head)
            data = data[len(head):]
        for i in range(len(data)):
            handler.write(data[i:i + 1])
            time.sleep(0.4)
    return respond


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickled_answer_ends_at_the_deadline(serve, caplog, where):
    server = serve(_trickle(where))
    runner = remote(server.url, timeout_s=1.5)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        batch = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)
    runner.close()
    assert time.monotonic() - start < 3.5  # a socket timeout alone: a byte every 0.4 s, 16 s or more
    assert batch.failures == 4 and "timed out, no whole answer within timeout_s=1.5s" in caplog.text
    with pytest.raises(HTTPRefusal, match=r"timed out") as err:
        HTTPClient(timeout_s=1.5).post_json(server.url + "/get_reward", {"query": ["a"]})
    assert err.value.kind == "deadline" and not err.value.retry


# -- class 7: credentials redacted, API keys from the environment or a file, never in the run's files ------------


def test_credentials_in_a_url_are_redacted_in_logs_and_lines(serve, caplog):
    server = serve(lambda h, b: send_json(h, {"error": "boom"}, status=500))
    url = server.url.replace("http://", "http://alice:hunter2@") + "/get_reward"
    runner = remote(url)
    with caplog.at_level(logging.WARNING):
        batch = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)
    runner.close()
    assert batch.failures == 4 and "HTTP 500" in caplog.text
    assert "hunter2" not in caplog.text and "alice" not in caplog.text and "http://***@127.0.0.1" in caplog.text
    problems = reward_problems("remote", {"url": url, "retries": 0})
    assert len(problems) == 1 and "hunter2" not in problems[0] and "HTTP 500" in problems[0]
    assert redact("see https://u:p@h:1/x and http://h/y") == "see https://***@h:1/x and http://h/y"


def _basic_auth(user, password, answer):
    want = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def respond(handler, body):
        if handler.headers.get("Authorization") != want:
            return send_json(handler, {"error": "unauthorized"}, status=401)
        answer(handler, body)
    return respond


def fake_openai(key=None, huge=False):
    """/v1/chat/completions as an OpenAI-compatible server answers it: completion "good" -> P(yes) = 0.8; with
    `key`, requests without `Authorization: Bearer key` are answered 401; `huge`: a 50 MB answer."""
    def respond(handler, body):
        if key is not None and handler.headers.get("Authorization") != f"Bearer {key}":
            return send_json(handler, {"error": {"message": "Incorrect API key provided", "type": "auth"}}, 401)
        if huge:
            return _lazy_body(50 * MB, True)(handler, body)
        request = json.loads(body)
        yes = 0.8 if "good" in request["messages"][0]["content"] else 0.3
        tops = [{"token": "yes", "logprob": math.log(yes), "bytes": None},
                {"token": "no", "logprob": math.log(1 - yes), "bytes": None}]
        logprobs = {"content": [{"token": "yes", "logprob": math.log(yes), "bytes": None, "top_logprobs": tops}]}
        send_json(handler, {"id": "x", "object": "chat.completion", "created": 0, "model": request["model"],
                            "choices": [{"index": 0, "finish_reason": "length", "logprobs": logprobs,
                                         "message": {"role": "assistant", "content": "yes"}}]})
    return respond


def judge(url, **options):
    return build_reward_runner("judge", {"base_url": url, "model": "m", "retries": 0, "timeout_s": 10, **options})


def test_the_judge_follows_no_307_and_sends_nothing_to_the_other_host(serve):
    pytest.importorskip("openai")
    other = serve(fake_openai())
    first = serve(redirect(307, other.url + "/v1/chat/completions"))
    runner = judge(first.url + "/v1")
    batch = runner(["What is 2+2? SECRET-PROMPT"], ["good"], ["4"])
    runner.close()
    assert batch.failures == 1 and batch.malformed.all() and other.hits == []
    problems = reward_problems("judge", {"base_url": first.url + "/v1", "model": "m", "retries": 0})
    assert len(problems) == 1 and "HTTP 307, a redirect to" in problems[0] and "follows no redirects" in problems[0]
    assert other.hits == []


def test_the_judge_reads_openai_api_key_or_a_key_file(serve, monkeypatch, tmp_path):
    pytest.importorskip("openai")
    server = serve(fake_openai(key="sk-from-env"))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    assert reward_problems("judge", {"base_url": server.url + "/v1", "model": "m"}) == []
    runner = judge(server.url + "/v1")
    batch = runner(["q"], ["good"], ["4"])
    runner.close()
    assert batch.failures == 0 and batch.scores.tolist() == pytest.approx([0.8])
    assert server.hits[-1][2].get("Authorization") == "Bearer sk-from-env"
    (tmp_path / "key").write_text("sk-from-file\n")
    filed = serve(fake_openai(key="sk-from-file"))
    runner = judge(filed.url + "/v1", api_key_file=str(tmp_path / "key"))
    assert runner(["q"], ["good"], ["4"]).failures == 0
    runner.close()
    assert reward_problems("judge", {"base_url": filed.url + "/v1", "model": "m", "api_key_file": "/nope"}) == [
        "reward.options.api_key_file='/nope' is not valid: expected a readable file that holds the API key"]


def test_an_api_key_setting_is_refused_without_repeating_it(serve):
    pytest.importorskip("openai")
    server = serve(fake_openai())
    problems = reward_problems("judge", {"base_url": server.url + "/v1", "model": "m", "api_key": "sk-SECRET"})
    assert len(problems) == 1 and problems[0].startswith("reward.options.api_key is not an option")
    assert "sk-SECRET" not in problems[0] and "OPENAI_API_KEY" in problems[0] and server.hits == []


def test_the_judges_answer_has_a_size_bound(serve):
    pytest.importorskip("openai")
    server = serve(fake_openai(huge=True))
    runner = judge(server.url + "/v1", max_response_bytes=MB)
    batch = runner(["q"], ["good"], ["4"])
    runner.close()
    assert batch.failures == 1 and server.sent[0] < 16 * MB


# -- class 8: the start check makes one real request of the run's kind ------------------------------------------


def test_the_start_check_refuses_credentials_the_server_refuses(serve, monkeypatch):
    server = serve(_basic_auth("alice", "right", scores(1.0)))
    good = server.url.replace("http://", "http://alice:right@")
    bad = server.url.replace("http://", "http://alice:wrong@")
    assert reward_problems("remote", {"url": good}) == []
    problems = reward_problems("remote", {"url": bad})
    assert len(problems) == 1 and "HTTP 401" in problems[0] and "refuses the credentials" in problems[0]
    assert "wrong" not in problems[0] and "right" not in problems[0]
    pytest.importorskip("openai")
    api = serve(fake_openai(key="sk-right"))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong")
    problems = reward_problems("judge", {"base_url": api.url + "/v1", "model": "m", "retries": 0})
    assert len(problems) == 1 and "the server refuses the API key" in problems[0] and "401" in problems[0]
    assert "sk-wrong" not in problems[0]


def test_the_start_check_refuses_https_to_a_plain_http_server(serve):
    server = serve(scores(1.0))
    tls = server.url.replace("http://", "https://")
    problems = reward_problems("remote", {"url": tls})
    assert len(problems) == 1 and problems[0].startswith(f"reward.options.url={tls!r}: the start check's")
    assert "TLS handshake failed" in problems[0]
    pytest.importorskip("openai")
    problems = reward_problems("judge", {"base_url": tls + "/v1", "model": "m", "retries": 0})
    assert len(problems) == 1 and "TLS handshake failed" in problems[0], problems


def test_the_start_check_refuses_a_server_of_another_protocol(serve):
    server = serve(lambda h, b: send_json(h, {"scores": [1.0] * len(json.loads(b)["query"])}))
    problems = reward_problems("remote", {"url": server.url})
    assert len(problems) == 1 and "not {'rewards': [one number per completion]}" in problems[0]
    assert reward_problems("remote", {"url": server.url, "score_key": "scores"}) == []


# -- class 7, end to end: train.py with the judge ----------------------------------------------------------------


def test_train_py_with_the_judge_keeps_the_key_out_of_every_file(serve, tmp_path):
    pytest.importorskip("openai")
    key = "sk-test-NEVER-IN-A-FILE-1234"
    server = serve(fake_openai(key=key))
    common = [sys.executable, "train.py", "reward=judge", f"reward.options.base_url={server.url}/v1",
              "reward.options.model=m", "data.batch_size=2", "algorithm.group_size=2", "data.num_test=2",
              "eval_before=false", "callbacks.progress=null", "trainer.max_steps=1"]
    env = {**os.environ, "OPENAI_API_KEY": key}
    done = subprocess.run([*common, f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(h[2].get("Authorization") == f"Bearer {key}" for h in server.hits)
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "hparams.yaml" for p in files) and any(p.name == "last.ckpt" for p in files)
    assert [p for p in files if key.encode() in p.read_bytes()] == []
    assert key not in done.stdout + done.stderr

    given = subprocess.run([*common, f"+reward.options.api_key={key}", f"hydra.run.dir={tmp_path / 'r2'}"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert given.returncode == 2 and "Traceback" not in given.stderr
    lines = [line for line in given.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and lines[0].startswith("config error: reward.options.api_key holds a secret")
    assert key not in given.stdout + given.stderr
    assert not (tmp_path / "r2").exists() or not [p for p in (tmp_path / "r2").rglob("*")
                                                   if p.is_file() and key.encode() in p.read_bytes()]


def test_a_password_in_a_url_setting_is_refused_before_any_request(serve):
    """A URL's login would reach hparams.yaml and last.ckpt with the settings: refused at construction, naming the
    key and never the password, before the server hears of it."""
    server = serve(_basic_auth("alice", "right", scores(1.0)))
    url = server.url.replace("http://", "http://alice:hunter2@") + "/get_reward"
    problems = secret_problems({"reward": {"name": "remote", "options": {"url": url}}})
    assert len(problems) == 1 and problems[0].startswith("reward.options.url holds a password")
    assert "hunter2" not in problems[0] and ".netrc" in problems[0]
    assert secret_problems({"reward": {"options": {"url": server.url + "/get_reward"}}}) == []
    with pytest.raises(ConfigError, match="reward.options.url holds a password") as err:
        GRPOModule(model="tiny", reward=RewardConfig("remote", {"url": url}))
    assert "hunter2" not in str(err.value) and server.hits == []


def test_a_token_in_a_urls_query_or_a_key_where_a_variables_name_goes_is_refused_before_anything_is_written(
        tmp_path):
    """Other ways a secret reaches the run's files: a URL's query (`?api_key=...`), and the key itself given where
    the name of the variable that holds it goes (`api_key_env`). Refused on the command line, before Hydra writes
    its folder, naming the key and never the secret; a query without one, and a variable's name, pass."""
    url = "http://127.0.0.1:5018/get_reward"
    (line,) = secret_problems({"reward": {"options": {"url": f"{url}?model=x&api_key=s3cr3tQ"}}})
    assert line.startswith("reward.options.url holds a secret in its URL's query (api_key)") and "s3cr3tQ" not in line
    assert secret_problems({"reward": {"options": {"url": f"{url}?monkey=1&tokens=2&page=3"}}}) == []
    (line,) = secret_problems({"reward": {"options": {"api_key_env": "sk-s3cr3tB"}}})
    assert line.startswith("reward.options.api_key_env is not the name of an environment variable")
    assert "s3cr3tB" not in line and secret_problems({"reward": {"options": {"api_key_env": "MY_KEY_2"}}}) == []
    for override in (f'reward.options.url="{url}?api_key=s3cr3tQ"', "+reward.options.api_key_env=sk-s3cr3tB"):
        done = subprocess.run([sys.executable, "train.py", "reward=remote", override,
                               f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 2 and "s3cr" not in done.stdout + done.stderr, done.stderr[-2000:]
        assert not (tmp_path / "run").exists()  # nothing written


def test_the_login_comes_from_netrc(serve, monkeypatch, tmp_path):
    """The way in for a login the settings may not hold: the file $NETRC names (requests reads it per host)."""
    server = serve(_basic_auth("alice", "right", scores(1.0)))
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login alice password right\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    runner = remote(server.url + "/get_reward")
    batch = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)
    runner.close()
    assert batch.failures == 0 and len(server.hits) == 1


def test_an_unknown_option_is_named_before_the_start_check_sends_anything(serve):
    server = serve(scores(1.0))
    problems = reward_problems("remote", {"url": server.url, "timeoutt": 3})
    assert problems == [problems[0]] and problems[0].startswith(
        "reward.options.timeoutt is not an option (did you mean reward.options.timeout_s?)")
    assert server.hits == []  # the typo is the run's only problem: no request before it is fixed


def test_a_reward_name_that_is_no_callable_is_refused_before_any_work():
    (line,) = reward_problems("os:sep")  # a str: every call of the run would fail, each one counted
    assert line.startswith("reward='os:sep': os:sep is a str, not a reward")


def test_the_start_check_sends_a_whole_chunk_as_the_run_will(serve):
    def one_at_a_time(handler, body):  # takes a request of one completion, refuses the run's chunks
        n = len(json.loads(body)["query"])
        send_json(handler, {"rewards": [1.0]} if n == 1 else {"detail": "too many"}, 200 if n == 1 else 413)

    server = serve(one_at_a_time)
    (line,) = reward_problems("remote", {"url": server.url, "batch_size": 4})
    assert line.startswith(f"reward.options.url={server.url!r}: the start check's request failed")
    assert "HTTP 413" in line
    assert [len(json.loads(hit[3])["query"]) for hit in server.hits] == [4]
