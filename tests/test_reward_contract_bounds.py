"""The reward contract at its bounds: a score exactly at ±score_bound passes and one past it is malformed and counted;
what counts as a number and as a malformed flag; None as a skip only for a term; one warning per kind; the failure
count of a batch; the in-process runner's failures, time bound and argument copies."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

from lit_rlvr.rewards.base import Failure, RewardContract, RewardResult, RewardRunner, plain_result, wait_or_stop


@pytest.mark.parametrize("score, ok", [(10.0, True), (-10.0, True), (10.000001, False), (-10.5, False), (0.0, True)])
def test_the_score_bound_is_inclusive(score, ok):
    contract = RewardContract(failure_score=-2.0, score_bound=10.0)
    result, broken = contract.check(score)
    assert broken is (not ok)
    assert (result.score, result.malformed) == ((score, False) if ok else (-2.0, True))


@pytest.mark.parametrize("bound", [0.0, -1.0])
def test_a_bound_that_is_not_positive_is_refused(bound):
    with pytest.raises(ValueError, match="reward.options.score_bound"):
        RewardContract(score_bound=bound)
    RewardContract(score_bound=1e-9)


@pytest.mark.parametrize("value, score", [(True, 1.0), (3, 3.0), (np.float32(0.5), 0.5), (np.array(2.0), 2.0),
                                          (torch.tensor(-1.5), -1.5), (torch.tensor(True), 1.0)])
def test_numbers_are_scores(value, score):
    result = plain_result(value)
    assert isinstance(result, RewardResult) and result.score == score and result.malformed is False


@pytest.mark.parametrize("value, kind", [(np.array([1.0]), "with a dimension"), (torch.ones(2), "with a dimension"),
                                         ("1", "returned str"), (None, "returned NoneType"),
                                         (10 ** 400, "score not a finite float"), (np.array(1 + 2j), "of complex")])
def test_anything_else_breaks_the_contract(value, kind):
    result = plain_result(value)
    assert not isinstance(result, RewardResult) and kind in result.kind


@pytest.mark.parametrize("flag, ok", [(True, True), (False, True), (0, True), (1, True), (np.bool_(True), True),
                                      (2, False), (-1, False), (0.0, False), ("no", False)])
def test_the_malformed_flag(flag, ok):
    result = plain_result(RewardResult(1.0, flag))
    assert isinstance(result, RewardResult) is ok
    if ok:
        assert result.malformed is bool(flag)


def test_info_is_kept_up_to_a_thousand_characters():
    assert plain_result(RewardResult(1.0, False, "x" * 1000)).info == "x" * 1000
    assert plain_result(RewardResult(1.0, False, "y" * 1001)).info == "y" * 1000
    assert plain_result(RewardResult(1.0, False, 12)).info == "12"


def test_none_is_a_skip_only_for_a_term():
    contract = RewardContract()
    _, broken = contract.check(None)
    assert broken
    contract.none_skips = True
    result, broken = contract.check(None)
    assert not broken and result.score == 0.0 and not result.malformed
    _, broken = contract.check("x")  # other breaches still count
    assert broken


def test_a_batch_counts_failures_and_breaches_and_warns_once_per_kind(caplog):
    contract = RewardContract(failure_score=-3.0)
    failure = contract.failed("raised")
    with caplog.at_level(logging.WARNING):
        batch = contract.batch([1.0, "a", "b", failure, float("nan"), RewardResult(0.5, True), None], failures=1)
    assert batch.scores.tolist() == [1.0, -3.0, -3.0, -3.0, -3.0, 0.5, -3.0]
    assert batch.malformed.tolist() == [False, True, True, True, True, True, True]
    assert batch.failed.tolist() == [False, True, True, True, True, False, True]
    assert batch.skipped.tolist() == [False] * 7
    assert batch.failures == 1 + 4  # the runner's one, and the four breaches ("a", "b", nan, None)
    warnings = [r.getMessage() for r in caplog.records if "warned once" in r.getMessage()]
    assert len(warnings) == 3  # str, non-finite, None: one each
    assert isinstance(failure, Failure) and contract.check(failure) == (failure, False)


def test_the_runner_counts_raising_calls_and_copies_arguments():
    seen = []

    def reward(prompt, completion, answer):
        answer.append("changed")
        seen.append(list(answer))
        if completion == "boom":
            raise RuntimeError("boom")
        return 1.0

    answer = ["a"]
    runner = RewardRunner(reward, failure_score=-5.0, timeout_s=5)
    try:
        batch = runner(["p", "p", "p"], ["ok", "boom", "ok"], [answer] * 3)
    finally:
        runner.close()
    assert batch.scores.tolist() == [1.0, -5.0, 1.0] and batch.failures == 1
    assert batch.failed.tolist() == [False, True, False]
    assert answer == ["a"] and seen == [["a", "changed"]] * 3  # each call its own copy


def test_the_runner_cuts_a_call_past_its_time_bound():
    def slow(prompt, completion, answer):
        if completion == "slow":
            for _ in range(200):
                time.sleep(0.01)
        return 1.0

    runner = RewardRunner(slow, timeout_s=0.2)
    try:
        batch = runner(["p", "p"], ["slow", "fast"], [None, None])
    finally:
        runner.close()
    assert batch.scores.tolist() == [-1.0, 1.0] and batch.failures == 1 and runner.stop_reason is None


@pytest.mark.parametrize("timeout", [0, -1])
def test_the_runner_refuses_a_time_bound_that_is_not_positive(timeout):
    with pytest.raises(ValueError, match="reward.options.timeout_s"):
        RewardRunner(lambda p, c, a: 1.0, timeout_s=timeout)


def test_a_bad_value_is_quoted_whole_up_to_60_characters():
    contract = RewardContract()
    whole, _ = contract.check(RewardResult(1.0, 10 ** 59))  # a malformed flag of 60 digits
    cut, _ = contract.check(RewardResult(1.0, 10 ** 60))  # 61 digits
    assert f"{10 ** 59}: malformed is True or False" in whole.info
    assert f"{str(10 ** 60)[:40]}... (61 characters)" in cut.info and str(10 ** 60) not in cut.info


def test_a_wait_on_a_call_looks_at_the_stop_request_every_tenth_of_a_second():
    asked = []

    def ready(seconds):
        asked.append(seconds)
        time.sleep(seconds)
        return False

    assert wait_or_stop(ready, 0.45) is False
    assert len(asked) >= 4 and max(asked) <= 0.1 and sum(asked) == pytest.approx(0.45, abs=0.1)


def test_a_cut_call_that_does_not_unwind_within_a_second_stops_the_run():
    """The cut raises inside the call; one that catches it and goes on for 1.2 s more is past the 1 s it may take
    to unwind: counted as not cut, and the run is told to stop."""
    def stubborn(prompt, completion, answer):
        try:
            for _ in range(1000):
                time.sleep(0.01)
        except BaseException:
            time.sleep(1.2)
        return 1.0

    runner = RewardRunner(stubborn, timeout_s=0.2)
    try:
        batch = runner(["p"], ["c"], [None])
    finally:
        runner.close()
    assert batch.failures == 1 and runner.stop_reason is not None and "could not be cut" in runner.stop_reason


class _OnlyItem:
    """Not a number, not an array: an `.item()` method without `ndim`."""

    def item(self):
        return 1.0


def test_an_object_with_item_but_no_dimensions_is_not_read_as_an_array():
    breach = plain_result(_OnlyItem())
    assert not isinstance(breach, RewardResult) and breach.kind == "returned _OnlyItem"


def test_a_breach_scores_minus_one_by_default():
    """docs/rewards.md: a failure or breach is scored `failure_score`, -1 unless set."""
    result, broken = RewardContract().check("not a number")
    assert broken and (result.score, result.malformed) == (-1.0, True)


def test_after_a_call_that_could_not_be_cut_the_rest_run_side_by_side():
    """Once `stop_reason` is set (a call overran and could not be cut: RewardRunner's docstring), the calls left run
    each on a thread of its own under one deadline: three calls that each wait for the other two all return."""
    meet = threading.Barrier(3, timeout=10)

    def together(prompt, completion, answer):
        meet.wait()
        return 1.0

    runner = RewardRunner(together, timeout_s=20)
    runner.stop_reason = "a call could not be cut"  # as `_not_cut` leaves it
    try:
        batch = runner(["p"] * 3, ["c"] * 3, [None] * 3)
    finally:
        runner.close()
    assert batch.failures == 0 and batch.scores.tolist() == [1.0, 1.0, 1.0]


def _spin(prompt, completion, answer):
    """Python code that overruns (a cut lands at its next bytecode); gives up by itself after 30 s."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        pass
    return 5.0


def _value(prompt, completion, answer):
    if answer == "raise":
        raise ValueError("bad: answer")
    if answer == "sleep":
        time.sleep(8)  # one blocking C call: a cut lands only when it returns
    return float(answer) if isinstance(answer, (int, float)) else 0.0


def _reward_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "reward-call"}


def test_side_by_side_cuts_what_overran_under_one_deadline_and_keeps_the_rest_in_order():
    """After a call could not be cut, the calls left run side by side: the overrunning ones are cut together after
    one `timeout_s` (timeouts, not "not cut": they were cut), the others keep their values in order, an argument that
    cannot be copied fails alone, and every thread started for the batch ends."""
    before = _reward_threads()

    def reward(prompt, completion, answer):
        if not threading.current_thread().daemon:  # an abandoned call must never hold the process's exit
            return -7.0
        return _spin(prompt, completion, answer) if answer == "spin" else _value(prompt, completion, answer)

    runner = RewardRunner(reward, timeout_s=0.3)
    runner.stop_reason = "a call could not be cut"
    jobs = [("p", "c", "spin"), ("p", "c", 2.0), ("p", "c", threading.Lock()), ("p", "c", "raise"),
            ("p", "c", 3.0), ("p", "c", "spin"), ("p", "c", "spin"), ("p", "c", "spin")]
    start = time.monotonic()
    outcomes = runner._score(jobs)
    took = time.monotonic() - start
    kinds = [getattr(o, "kind", getattr(o, "score", o)) for o in outcomes]
    assert kinds == ["timeout", 2.0, "arguments not copied", "raised ValueError", 3.0, "timeout", "timeout", "timeout"]
    assert took < 2.5, took  # one deadline for all four (0.3 s) and the cut's unwinding, not 0.3 s or more each
    end = time.monotonic() + 5
    while _reward_threads() - before and time.monotonic() < end:
        time.sleep(0.05)
    assert not _reward_threads() - before  # each thread ran one call and ended


def test_side_by_side_calls_blocked_in_c_past_the_cut_grace_are_not_cut_and_the_batch_does_not_wait_for_them():
    """Calls blocked in one C call (`time.sleep`) cannot be cut: after the deadline (0.3 s) and one cut grace shared
    by all (1 s) the batch returns them as "not cut" and leaves them to their daemon threads, rather than waiting
    until they end (8 s) or a grace each (3 s). (Under a coverage tracer the wait lasts until the calls end.)"""
    runner = RewardRunner(_value, timeout_s=0.3)
    runner.stop_reason = "a call could not be cut"
    start = time.monotonic()
    outcomes = runner._score([("p", "c", "sleep"), ("p", "c", 1.0), ("p", "c", "sleep"), ("p", "c", "sleep")])
    assert time.monotonic() - start < 2.9
    assert [getattr(o, "kind", getattr(o, "score", o)) for o in outcomes] == ["not cut", 1.0, "not cut", "not cut"]
    assert all(t.daemon for t in _reward_threads())  # an abandoned call never holds the process's exit
