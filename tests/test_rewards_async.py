"""Async rewards (issue 43): `async def` rewards awaited concurrently under `reward.options.max_concurrent`, with
the same time bound and failure rule as a sync reward."""

import time

import pytest
import torch  # noqa: F401  (the runner builds tensors: loaded before a clock starts)

from lit_rlvr.rewards import build_reward_runner, reward_problems
from lit_rlvr.rewards.async_runner import AsyncRewardRunner
from tests.source_rewards import Inflight


def test_async_calls_overlap_under_the_cap():
    fn = Inflight(delay_s=0.05)
    runner = AsyncRewardRunner(fn, max_concurrent=8, timeout_s=5)
    start = time.monotonic()
    batch = runner(["p"] * 32, ["c"] * 32, [None] * 32)
    wall = time.monotonic() - start
    runner.close()
    assert batch.scores.tolist() == [1.0] * 32 and batch.failures == 0
    assert fn.most == 8  # never above the cap, and the cap is used
    assert wall < 32 * 0.05 / 2  # 4 waves of 50 ms, not 32 calls one after another (generous on a loaded CPU)


def test_an_async_reward_is_found_by_name_and_follows_the_failure_rule(caplog):
    runner = build_reward_runner("tests.source_rewards:async_by_kind", {"timeout_s": 0.5, "max_concurrent": 4})
    assert isinstance(runner, AsyncRewardRunner)
    batch = runner(["p"] * 4, ["ok", "raise", "str", "ok"], [0, 0, 0, 5])  # the last one overruns its bound
    runner.close()
    assert batch.scores.tolist() == [1.0, -1.0, -1.0, -1.0]
    assert batch.malformed.tolist() == [False, True, True, True]
    assert batch.failures == 3 and batch.failed.tolist() == [False, True, True, True]
    assert "timeout after 0.5s (reward.options.timeout_s)" in caplog.text and "async boom" in caplog.text


def test_a_coroutine_that_blocks_the_loop_sets_stop_reason():
    runner = build_reward_runner("tests.source_rewards:async_by_kind", {"timeout_s": 0.2, "max_concurrent": 1})
    runner_grace = __import__("lit_rlvr.rewards.async_runner", fromlist=["_GRACE_S"])
    old, runner_grace._GRACE_S = runner_grace._GRACE_S, 0.3
    try:
        batch = runner(["p"], ["block"], [0])
    finally:
        runner_grace._GRACE_S = old
    assert batch.failures == 1 and "reward.options.timeout_s" in runner.stop_reason
    assert "time.sleep" in runner.stop_reason
    runner.close()


def test_an_async_reward_in_weighted_terms():
    runner = build_reward_runner("terms", {"terms": {"a": {"reward": "tests.source_rewards:async_by_kind",
                                                           "weight": 0.5}, "arithmetic": 1.0}})
    batch = runner(["p", "p"], ["0", "raise"], [0, 0])  # the answer is also the async reward's await (s)
    runner.close()
    assert batch.scores.tolist() == [1.5, -1.0] and batch.failures == 1


def test_async_settings_checked_one_line():
    assert reward_problems("tests.source_rewards:async_by_kind", {"max_concurrent": 0}) == [
        "reward.options.max_concurrent=0 is not valid: expected an integer >= 1 (calls in flight)"]
    with pytest.raises(ValueError, match="^reward.options.isolation='process' is not valid: expected none for an "
                                         "async reward"):
        build_reward_runner("tests.source_rewards:async_by_kind", {"isolation": "process"})
    with pytest.raises(ValueError, match="^reward.options.max_concurrent=4 caps an async reward's calls"):
        build_reward_runner("arithmetic", {"max_concurrent": 4})


def test_a_shared_max_concurrent_goes_to_the_async_terms_only():
    runner = build_reward_runner("terms", {"terms": {"a": {"reward": "tests.source_rewards:async_by_kind"},
                                                     "arithmetic": 1.0}, "max_concurrent": 3})
    assert runner.terms[0].runner.max_concurrent == 3
    batch = runner(["p"], ["0"], [0])  # async: 1.0 after a 0 s await; arithmetic: "0" is right
    runner.close()
    assert batch.scores.tolist() == [2.0] and batch.failures == 0
