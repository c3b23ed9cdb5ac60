"""The code sandbox by URL (issue 43): `reward=code reward.options.sandbox_url=...` sends programs to a
SandboxFusion-compatible `run_code` endpoint, here a server the test starts that runs them in the project's own
local sandbox (tests/sandbox_server.py): stdin and call-based tests, the time limit, the cap on requests in
flight, a server that is not there at start (one line) or goes away mid-run (malformed, counted)."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch  # noqa: F401  (the runner builds tensors)

from lit_rlvr.rewards import build_reward_runner, reward_problems

REPO = Path(__file__).resolve().parents[1]
ECHO_SUM = "```python\nprint(sum(map(int, input().split())))\n```"
ADD = "```python\ndef add(a, b):\n    return a + b\n```"
LOOP = "```python\nwhile True:\n    pass\n```"
STDIN_SPEC = {"inputs": ["1 2", "3 4"], "outputs": ["3", "7"]}
CALL_SPEC = {"inputs": [[1, 2], [5, 5]], "outputs": [3, 10], "fn_name": "add"}


@pytest.fixture
def sandbox_server():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "sandbox_server.py")], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
    yield proc, url
    proc.kill()
    proc.wait()


def test_programs_run_on_the_sandbox_server(sandbox_server):
    proc, url = sandbox_server
    runner = build_reward_runner("code", {"sandbox_url": url, "max_concurrent": 2, "timeout_s": 2})
    completions = [ECHO_SUM, ADD, "no code", LOOP, "```python\nprint(0)\n```"]
    answers = [STDIN_SPEC, CALL_SPEC, STDIN_SPEC, STDIN_SPEC, STDIN_SPEC]
    batch = runner(["p"] * 5, completions, answers)
    runner.close()
    assert batch.scores.tolist() == [1.0, 1.0, -1.0, -1.0, -1.0]
    assert batch.malformed.tolist() == [False, False, True, False, False]  # a timeout is a wrong answer
    assert batch.failures == 0
    stats = json.loads(urllib.request.urlopen(url + "/stats").read())
    assert stats["requests"] >= 5 and stats["most_in_flight"] <= 2


def test_a_sandbox_server_that_goes_away_costs_its_rollouts(sandbox_server):
    proc, url = sandbox_server
    runner = build_reward_runner("code", {"sandbox_url": url, "timeout_s": 2})
    proc.kill()
    proc.wait()
    batch = runner(["p"] * 2, [ECHO_SUM, ADD], [STDIN_SPEC, CALL_SPEC])
    runner.close()
    assert batch.failures == 2 and batch.malformed.all() and (batch.scores == -1).all()


def test_sandbox_url_settings_checked_before_any_work():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    problems = reward_problems("code", {"sandbox_url": url})
    assert len(problems) == 1 and problems[0].startswith(f"reward.options.sandbox_url={url!r}: the server cannot "
                                                         "be reached")
    assert reward_problems("code", {"sandbox_url": "nope"})[0].startswith("reward.options.sandbox_url='nope' is "
                                                                           "not valid")
    assert reward_problems("code", {}) == []  # the local sandbox
    with pytest.raises(ValueError, match="^reward.options.max_concurrent=4 caps the requests to "
                                         "reward.options.sandbox_url, which is not set"):
        build_reward_runner("code", {"max_concurrent": 4})
