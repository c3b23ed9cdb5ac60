"""A reward server by URL (issue 43): OpenRLHF's /get_reward protocol against a real HTTP server process that the
test starts (examples/reward_server.py, the standard library's http.server): batched requests under a cap, a slow
server (timeout), one that answers garbage, one that dies mid-run, one that cannot be reached at start."""

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (the runner builds tensors: loaded before a clock starts)

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.rewards import build_reward_runner, reward_problems
from lit_rlvr.rewards.remote import RemoteReward, endpoint

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
ANSWERS = [2, 4, 6, 8]


def _start(*args):
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "reward_server.py"), "--port", "0", *args],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def server(request):
    procs = []

    def start(*args):
        proc, url = _start(*args)
        procs.append(proc)
        return proc, url

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _runner(url, **options):
    return build_reward_runner("remote", {"url": url, "batch_size": 2, "max_concurrent": 2, "timeout_s": 5,
                                          "retries": 1, "backoff_s": 0.05, **options})


def test_scores_batches_over_openrlhf_protocol(server):
    _, url = server()
    runner = _runner(url)
    batch = runner(PROMPTS, ["2", "5", "6 is it", "x"], ANSWERS)
    runner.close()
    assert batch.scores.tolist() == [1.0, -1.0, 1.0, -1.0] and batch.failures == 0
    assert endpoint(url) == url + "/get_reward" and endpoint(url + "/score") == url + "/score"


def test_a_slow_server_times_out_only_its_rollouts(server, caplog):
    _, url = server("--mode", "slow", "--delay-s", "3")
    runner = _runner(url, timeout_s=0.5)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        batch = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)
    runner.close()
    assert batch.failures == 4 and batch.malformed.all() and (batch.scores == -1).all()
    assert time.monotonic() - start < 2.5  # not retried: a second try would wait as long again
    assert "timed out" in caplog.text and url in caplog.text


def test_garbage_answers_make_only_those_rollouts_malformed(server, caplog):
    _, url = server("--mode", "garbage")
    runner = _runner(url, max_concurrent=1)  # chunk 1: not JSON; chunk 2: a list of the wrong length
    with caplog.at_level(logging.WARNING):
        batch = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)
    runner.close()
    assert batch.failures == 4 and batch.malformed.all()
    assert "JSONDecodeError" in caplog.text and "expected {'rewards': [one number per completion (2)]}" in caplog.text


def test_non_numbers_in_the_answer_are_malformed_by_the_contract(server):
    _, url = server()
    runner = _runner(url, batch_size=4)
    reward = runner.fn  # what a server of another author might answer
    reward._post = lambda body: {"rewards": [0.5, "1.0", None, float("nan")]}
    batch = runner(PROMPTS, ["a", "b", "c", "d"], ANSWERS)
    runner.close()
    assert batch.scores.tolist() == [0.5, -1.0, -1.0, -1.0] and batch.failures == 3


def test_a_server_that_dies_mid_run_costs_its_rollouts_never_the_run(server, caplog):
    proc, url = server("--mode", "die-after", "--n", "2")
    runner = _runner(url, max_concurrent=1)
    first = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)  # two requests: answered
    with caplog.at_level(logging.WARNING):
        second = runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)  # the server exits: retried, then counted
    proc.wait(10)
    third = runner(PROMPTS[:1], ["2"], ANSWERS[:1])  # refused from now on: still counted, never raised
    runner.close()
    assert first.failures == 0 and first.scores.tolist() == [1.0] * 4
    assert second.failures == 4 and second.malformed.all() and third.failures == 1
    assert "reward server" in caplog.text


def test_an_unreachable_server_stops_the_run_before_any_work_naming_the_url(monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/get_reward"
    problems = reward_problems("remote", {"url": url})
    assert len(problems) == 1 and problems[0].startswith(f"reward.options.url={url!r}: the server cannot be reached")
    import lit_rlvr.module as module

    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match="the server cannot be reached"):
        module.GRPOModule(reward="remote", reward_options={"url": url})


@pytest.mark.parametrize("options, line", [
    ({}, "reward=remote needs reward.options.url"),
    ({"url": "???"}, "reward.options.url=??? is not valid"),
    ({"url": "localhost:5000"}, "reward.options.url='localhost:5000' is not valid"),
    ({"url": "http://127.0.0.1:1", "batch_size": 0}, "reward.options.batch_size=0 is not valid"),
    ({"url": "http://127.0.0.1:1", "retries": -1}, "reward.options.retries=-1 is not valid"),
    ({"url": "http://127.0.0.1:1", "timeout_s": 0}, "reward.options.timeout_s=0 is not valid"),
])
def test_remote_settings_one_line_each(options, line):
    problems = reward_problems("remote", options)
    assert len(problems) == 1 and problems[0].startswith(line), problems


def test_train_py_refuses_the_shipped_remote_config_without_a_url():
    from hydra import compose, initialize_config_module

    from lit_rlvr.app.config_check import check_config

    with initialize_config_module("lit_rlvr.conf", version_base="1.3"):
        cfg = compose("config", overrides=["reward=remote"])
    with pytest.raises(ConfigError, match=r"^reward.options.url=\?\?\? is not valid"):
        check_config(cfg)


def test_remote_reward_is_picklable_for_worker_processes():
    import pickle

    reward = RemoteReward("http://127.0.0.1:1")  # no network until the first request
    reward.score_batch  # noqa: B018
    assert pickle.loads(pickle.dumps(reward)).url == "http://127.0.0.1:1/get_reward"


def test_a_stop_request_past_its_grace_does_not_wait_for_a_slow_server(server):
    """Issue 61, class 4: a request may take its timeout_s (30 s here); a stop older than its grace ends the wait."""
    import threading

    from lit_rlvr.config.errors import StopRequested
    from lit_rlvr.run.stop import STOP

    _, url = server("--mode", "slow", "--delay-s", "20")
    runner = _runner(url, timeout_s=30)
    STOP.arm(0.5)
    timer = threading.Timer(1.0, STOP.request, ("SIGTERM",))
    try:
        timer.start()
        start = time.monotonic()
        with pytest.raises(StopRequested):
            runner(PROMPTS, ["2", "4", "6", "8"], ANSWERS)
        assert time.monotonic() - start < 8  # not the server's 20 s
    finally:
        timer.cancel()
        STOP.arm(None)
        runner.close()
