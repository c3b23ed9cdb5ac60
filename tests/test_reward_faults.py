"""Rewards and the code sandbox under attack (issue 19, points 2-7): the reward contract, a time bound on every
call in every isolation mode, a timeout that replaces one worker only, workers that die with the trainer, and
a sandbox with its own IPC namespace and no path to filesystem Unix sockets. With FAULT_REPORT=PATH each
test appends a JSON line (scripts/fault_report.py)."""

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lit_rlvr.rewards import build_reward_runner
from lit_rlvr.rewards.base import ProcessRewardRunner, RewardRunner
from tests.test_faults import SMALL, Run, report
from tests import reward_helpers as H

REPO = Path(__file__).resolve().parents[1]
KINDS = ["0.5", "1", "True", "str", "None", "dict", "1e308", "SystemExit", "KeyboardInterrupt", "result"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`python train.py` runs, started together (each ~1 min on a loaded 2-core machine)."""
    root = tmp_path_factory.mktemp("reward_faults")
    started = {
        "contract": Run(root / "contract", "reward.name=tests.reward_helpers:contract_breaker", "trainer.max_steps=2"),
        "hang_none": Run(root / "hang_none", "reward.name=tests.reward_helpers:sleeping_reward",
                         "+reward.options.timeout_s=1", "trainer.max_steps=3", "eval_before=true"),
        "nan_no_ckpt": Run(root / "nan_no_ckpt", "algorithm._target_=tests.fault_helpers.FaultyModule",
                           "+algorithm.nan_from=1", "algorithm.max_bad_steps=1", "checkpoint_every=100",
                           "trainer.max_steps=3"),
    }
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()


# -- point 7: the reward contract ---------------------------------------------------------------------------

def _contract_batch(runner):
    completions = ["x" * k for k in range(10)]  # length k → kind k of contract_breaker
    return runner(["1+1"] * 10, completions, ["2"] * 10)


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_reward_contract_numbers_are_scores_the_rest_malformed_once(isolation, caplog):
    runner = build_reward_runner("tests.reward_helpers:contract_breaker", {"isolation": isolation, "workers": 1}
                                 if isolation == "process" else {})
    try:
        with caplog.at_level(logging.WARNING):
            batch = _contract_batch(runner)
            _contract_batch(runner)
    finally:
        runner.close()
    assert batch.scores[:3].tolist() == [0.5, 1.0, 1.0] and not batch.malformed[:3].any()
    assert batch.malformed[3:9].all() and (batch.scores[3:9] == -1.0).all()  # str, None, dict, 1e308, exits
    assert batch.failures == 6 and torch.isfinite(batch.scores).all()
    warned = [r.getMessage() for r in caplog.records if "returned" in r.getMessage()]
    assert len([m for m in warned if "returned str" in m]) == 1  # once per type, not per call (20 calls)
    assert any("returned NoneType" in m for m in warned) and any("returned dict" in m for m in warned)
    assert any("score_bound" in r.getMessage() for r in caplog.records)


def test_score_bound_is_configurable():
    runner = build_reward_runner("tests.reward_helpers:echo_reward", {"score_bound": 1e9})
    assert runner(["p"], ["pid"], [0]).scores.tolist() == [float(os.getpid())]
    with pytest.raises(ValueError, match="score_bound"):
        build_reward_runner("arithmetic", {"score_bound": 0})


def test_contract_breaking_rewards_do_not_stop_a_default_run(runs):
    """Floats, strings, None, 1e308, SystemExit and KeyboardInterrupt from the reward: the run ends normally."""
    run = runs["contract"]
    rc, log = run.wait()
    assert rc == 0, log[-3000:]
    summary = run.summary()
    assert summary["steps"] == 2 and summary["reward_failures"] > 0
    assert all(torch.isfinite(torch.tensor(float(r["reward/mean"]))) for r in run.rows())
    report(fault="reward returns str/None/1e308/exits", bad_inputs=summary["reward_failures"], survived=True,
           data_lost=0)


def test_non_finite_error_does_not_claim_a_checkpoint_that_is_not_there(runs):
    run = runs["nan_no_ckpt"]
    rc, log = run.wait()
    assert rc != 0 and "NonFiniteError" in log, log[-3000:]
    assert not (run.dir / "checkpoints" / "last.ckpt").exists()
    assert "is intact" not in log and "no checkpoint was written yet" in log
    report(fault="NaN before the first checkpoint", bad_inputs=1, survived=False, stopped_cleanly=True, data_lost=0)


# -- point 4: every call bounded in time under isolation none --------------------------------------------

def test_in_process_python_loop_is_cut_and_counted():
    runner = RewardRunner(H.looping_reward, timeout_s=0.5)
    batch = runner(["p"] * 3, ["a", "loop", "b"], [0] * 3)
    assert batch.scores.tolist() == [1.0, -1.0, 1.0] and batch.malformed.tolist() == [False, True, False]
    assert batch.failures == 1 and runner.stop_reason is None
    assert runner(["p"], ["c"], [0]).scores.tolist() == [1.0]  # a fresh thread after the cut


def test_in_process_call_blocked_in_c_sets_stop_reason_naming_the_keys():
    runner = RewardRunner(H.sleeping_reward, timeout_s=0.5)
    done = []
    thread = threading.Thread(target=lambda: done.append(runner(["1+1"] * 2, ["ab", "a"], ["2", "2"])), daemon=True)
    thread.start()
    thread.join(timeout=60)  # bounded: timeout + the cut's grace
    assert done, "the in-process reward call was not bounded"
    assert done[0].failures == 1 and done[0].malformed.tolist()[0]
    assert "reward.options.timeout_s" in runner.stop_reason and "reward.options.isolation=process" in runner.stop_reason


def test_hanging_reward_under_default_isolation_stops_with_a_checkpoint(runs):
    """isolation none (the default), eval_before=true: the step finishes, last.ckpt is saved, the error names
    reward.options.timeout_s and reward.options.isolation=process."""
    run = runs["hang_none"]
    rc, log = run.wait()
    assert rc != 0 and "RewardHangError" in log, log[-3000:]
    assert "reward.options.timeout_s=1" in log and "reward.options.isolation=process" in log
    assert "resume=" in log and "is intact" in log
    state = run.checkpoint()
    assert state["global_step"] >= 1  # saved at the step of the hang (eval_before's hang would stop before)
    report(fault="reward hangs, isolation none", bad_inputs=1, survived=False, stopped_cleanly=True, data_lost=0)


# -- point 5: a timeout replaces the hung worker only; workers import little ----------------------------------

def test_process_timeout_replaces_only_the_hung_worker():
    with ProcessRewardRunner(H.echo_reward, timeout_s=1.0, workers=2, score_bound=1e9) as runner:
        runner(["p"] * 2, ["a", "b"], [0, 0])
        before = {w.proc.pid for w in runner._pool}
        batch = runner(["p"] * 4, ["hang", "a", "b", "c"], [0] * 4)
        after = {w.proc.pid for w in runner._pool}
    assert batch.failures == 1 and batch.malformed.tolist() == [True, False, False, False]
    assert len(before & after) == 1 and len(after) == 2  # the busy neighbour was not killed
    report(fault="reward timeout, isolation process", bad_inputs=1, survived=True, data_lost=0)


def test_reward_workers_do_not_import_torch_or_lightning():
    with ProcessRewardRunner(H.echo_reward, timeout_s=60.0, workers=1) as runner:
        assert runner(["p"], ["modules"], [0]).scores.tolist() == [1.0]


# -- point 6: workers die with the trainer ----------------------------------------------------------------

TRAINER = """
import sys
from lit_rlvr.rewards.base import ProcessRewardRunner
from tests.reward_helpers import echo_reward
runner = ProcessRewardRunner(echo_reward, timeout_s=3600, workers=2)
runner(["p"] * 2, ["spin", "spin"], [0, 0])
"""


def test_kill_9_of_the_trainer_leaves_no_worker(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", TRAINER], cwd=REPO, env={**os.environ, "PID_DIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list(tmp_path.iterdir())) < 2:
            time.sleep(0.2)
        pids = [int(p.name) for p in tmp_path.iterdir()]
        assert len(pids) == 2, "the workers did not start"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), f"reward workers {pids} outlived the trainer"
    report(fault="kill -9 of the trainer", bad_inputs=1, survived=False, stopped_cleanly=True, data_lost=0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead (its parent may reap it later)
    except FileNotFoundError:
        return False
