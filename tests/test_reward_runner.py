"""The reward runners' one base (issue 59) and their waits (issue 61, classes 4 and 5): every runner is a `Runner`
with its settings in `RunnerOptions` (checked where defined, one line naming key, value and what is allowed); a
stop request older than its grace ends every wait on a reward call, in every isolation mode; once a call is found
uncuttable, the rest of the batch does not wait for it call by call, and each kind of failure is warned once."""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
import torch  # noqa: F401  (the runners build tensors: loaded before a clock starts)

from lit_rlvr.config.errors import ConfigError, StopRequested
from lit_rlvr.rewards import build_reward_runner, reward_problems
from lit_rlvr.rewards.async_runner import AsyncRewardRunner
from lit_rlvr.rewards.base import RewardRunner, Runner
from lit_rlvr.rewards.batch import BatchRewardRunner
from lit_rlvr.rewards.options import RunnerOptions
from lit_rlvr.rewards.terms import TermsRunner
from lit_rlvr.rewards.workers import ProcessRewardRunner
from lit_rlvr.run.stop import STOP
from tests import reward_helpers as H


# -- one base, one settings class ------------------------------------------------------------------------------

def test_every_runner_is_a_runner_with_its_settings_in_one_class(tmp_path):
    built = {
        RewardRunner: build_reward_runner("arithmetic", {"timeout_s": 3}),
        ProcessRewardRunner: build_reward_runner("arithmetic", {"isolation": "process", "workers": 1}),
        AsyncRewardRunner: build_reward_runner("tests.source_rewards:async_by_kind", {"max_concurrent": 3}),
        BatchRewardRunner: build_reward_runner("code", {"tmp_root": str(tmp_path)}),
        TermsRunner: build_reward_runner("terms", {"terms": {"arithmetic": 1.0}, "score_bound": 5}),
    }
    try:
        for cls, runner in built.items():
            assert type(runner) is cls and isinstance(runner, Runner)
            assert isinstance(runner.options, RunnerOptions)
        assert built[RewardRunner].timeout_s == 3.0 and built[ProcessRewardRunner].workers == 1
        assert built[AsyncRewardRunner].max_concurrent == 3 and built[TermsRunner].contract.score_bound == 5.0
        batch = built[TermsRunner](["1+1"] * 2, ["2", "3"], ["2", "2"])
        assert batch.scores.tolist() == [1.0, -1.0] and batch.failures == 0
    finally:
        for runner in built.values():
            runner.close()


@pytest.mark.parametrize("options, line", [
    ({"isolation": "threads"}, "reward.options.isolation='threads' is not valid: expected one of none, process"),
    ({"timeout_s": 0}, "reward.options.timeout_s=0 is not valid: expected a number of seconds > 0"),
    ({"timeout_s": math.nan}, "reward.options.timeout_s=nan is not valid: expected a number of seconds > 0"),
    ({"timeout_s": "soon"}, "reward.options.timeout_s='soon' is not valid: expected a number of seconds > 0"),
    ({"workers": 0}, "reward.options.workers=0 is not valid: expected an integer >= 1 (worker processes)"),
    ({"workers": 1.5}, "reward.options.workers=1.5 is not valid: expected an integer >= 1 (worker processes)"),
    ({"score_bound": -1}, "reward.options.score_bound=-1 is not valid: expected a number > 0 (|score| above it "
                          "is malformed)"),
    ({"max_concurrent": True}, "reward.options.max_concurrent=True is not valid: expected an integer >= 1 (calls "
                               "in flight)"),
])
def test_runner_settings_are_checked_where_defined_one_line_each(options, line):
    with pytest.raises(ConfigError) as err:
        RunnerOptions(**options)
    assert err.value.problems == [line]
    assert reward_problems("arithmetic", options) == [line]  # train.py's check before any work: the same line
    with pytest.raises(ConfigError, match=f"^{line[:30]}"):
        build_reward_runner("arithmetic", options)


def test_runner_settings_split_from_the_rewards_own_and_numbers_from_a_command_line():
    runner, own = RunnerOptions.split({"timeout_s": "2", "workers": "3", "isolation": "process", "format_weight": 1})
    assert (runner.timeout_s, runner.workers, runner.isolation) == (2.0, 3, "process")
    assert own == {"format_weight": 1} and runner.cap == 64
    with pytest.raises(ConfigError, match=r"^reward\.options\.terms\.a\.options\.workers=0 is not valid"):
        RunnerOptions(workers=0, key="reward.options.terms.a.options")


def test_runner_keys_that_would_mean_nothing_are_refused_before_any_work():
    assert reward_problems("arithmetic", {"workers": 2}) == [
        "reward.options.workers=2 sets the worker processes of reward.options.isolation=process, and "
        "reward='arithmetic' runs in the training process (isolation=none); set isolation=process, or remove "
        "workers"]
    (line,) = reward_problems("arithmetic", {"isolation": "process", "max_concurrent": 4})
    assert line.startswith("reward.options.max_concurrent=4 caps an async reward's calls in flight")
    assert reward_problems("arithmetic", {"isolation": "process", "workers": 2, "timeout_s": 1}) == []
    (line,) = reward_problems("terms", {"terms": {"arithmetic": 1.0, "f": {"reward": "format",
                                                                         "options": {"workers": 3}}}})
    assert line.startswith("reward.options.terms.f.options.workers=3 sets the worker processes")


# -- class 5: an uncuttable call does not cost its timeout for every call of the batch ------------------------

def test_once_a_call_cannot_be_cut_the_rest_of_the_batch_shares_one_deadline(caplog):
    """8 calls that block in C with timeout_s=0.5: call by call that was 8 x (0.5 s + 1 s of cut grace) = 12 s
    and 8 warnings; now the first call's 1.5 s, then the other 7 side by side under one more 1.5 s; one warning."""
    runner = RewardRunner(H.echo_reward, timeout_s=0.5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        batch = runner(["p"] * 9, ["hang"] * 4 + ["ok"] + ["hang"] * 4, [0] * 9)
    took = time.monotonic() - started
    assert batch.failures == 8 and batch.malformed.tolist() == [True] * 4 + [False] + [True] * 4
    assert batch.scores[4] > 1  # the call that did not hang was scored (the pid of the process)
    assert took < 6.0, f"{took:.1f}s: the batch waited for its blocked calls one by one"
    assert "reward.options.isolation=process" in runner.stop_reason
    assert len([r for r in caplog.records if "reward call failed" in r.getMessage()]) == 1  # once per kind
    started = time.monotonic()
    again = runner(["p"] * 4, ["hang"] * 4, [0] * 4)  # the next batch of the step: one deadline too
    assert again.failures == 4 and time.monotonic() - started < 4.0
    runner.close()


def test_failures_of_a_kind_are_warned_once_and_each_counted(caplog):
    runner = build_reward_runner("tests.source_rewards:by_kind", {})
    with caplog.at_level(logging.WARNING):
        batch = runner(["p"] * 6, ["raise", "raise", "ok", "raise", "str", "str"], [0] * 6)
    runner.close()
    assert batch.failures == 5 and batch.failed.tolist() == [True, True, False, True, True, True]
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "RuntimeError: boom" in m]) == 1
    assert len([m for m in messages if "returned str" in m]) == 1


# -- class 4: every wait on a reward call honours a stop request ------------------------------------------------

async def _blocks_the_loop(prompt, completion, answer):
    time.sleep(30)  # sync code in a coroutine: nothing can cancel it
    return 1.0


@pytest.mark.parametrize("make", [
    lambda: RewardRunner(H.echo_reward, timeout_s=60),
    lambda: ProcessRewardRunner(H.echo_reward, timeout_s=60, workers=1),
    lambda: AsyncRewardRunner(_blocks_the_loop, timeout_s=60),
    lambda: build_reward_runner("terms", {"terms": {"e": {"reward": "tests.reward_helpers:echo_reward",
                                                          "options": {"score_bound": 1e9}}}, "timeout_s": 60}),
], ids=["thread", "process", "async", "terms"])
def test_a_stop_request_past_its_grace_ends_the_wait_on_a_blocked_call(make):
    """A call that blocks far past the stop's grace, with a timeout longer still: the wait ends once the request
    is older than the grace (0.5 s here), not when the call's timeout does."""
    runner = make()
    STOP.arm(0.5)
    timer = threading.Timer(1.0, STOP.request, ("SIGTERM",))
    try:
        timer.start()
        started = time.monotonic()
        with pytest.raises(StopRequested, match="SIGTERM"):
            runner(["p"] * 2, ["hang", "hang"], [0, 0])
        assert time.monotonic() - started < 15  # the zygote's start included; the calls' timeouts are 60 s
    finally:
        timer.cancel()
        STOP.arm(None)
        runner.close()
    assert runner.stop_reason is None  # a stop is not a hang: nothing to report beyond the stop itself


def test_a_code_batch_does_not_defer_a_stop_for_its_programs(tmp_path):
    """The code reward's programs are bounded by their own limits (60 s here); a stop past its grace ends the wait
    for them, and a batch after it does not start."""
    runner = build_reward_runner("code", {"tmp_root": str(tmp_path), "timeout_s": 60, "workers": 1})
    program = "```python\nimport time\ntime.sleep(6)\n```"
    STOP.arm(0.5)
    timer = threading.Timer(1.0, STOP.request, ("SIGTERM",))
    try:
        timer.start()
        started = time.monotonic()
        with pytest.raises(StopRequested):
            runner(["p"] * 2, [program] * 2, [{"inputs": [""], "outputs": ["1"]}] * 2)
        assert time.monotonic() - started < 5  # not the program's 6 s
        with pytest.raises(StopRequested):
            runner(["p"], ["```python\nprint(1)\n```"], [{"inputs": [""], "outputs": ["1"]}])
    finally:
        timer.cancel()
        STOP.arm(None)
        runner.close()
        time.sleep(max(0.0, started + 9 - time.monotonic()))  # the abandoned program ends at its own time
