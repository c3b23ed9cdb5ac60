"""Reward functions are plain callables: ``fn(prompt, completion, answer) -> RewardResult`` (or a plain number).

The contract, enforced on every result (`RewardContract`): a `RewardResult` or a plain float/int/bool is a
score; anything else (a str, None, a dict) is a malformed result, counted, with one warning naming the type; a
score that is not finite or lies outside ±`score_bound` is malformed too (1e308 would turn the advantages into
NaN). A reward that raises anything (SystemExit and KeyboardInterrupt included) is a counted failure.

`RewardRunner` scores a batch in the training process, each call on a watchdog thread bounded by `timeout_s`:
an overrunning call is cut (an exception raised in its thread) and counted; a call that cannot be cut (blocked
in C code) is counted and sets `stop_reason`, on which the module saves a checkpoint and stops the run.
`ProcessRewardRunner` (lit_rlvr/rewards/workers.py) runs the calls in worker processes that can always be killed.
"""

from __future__ import annotations

import ctypes
import logging
import math
import numbers
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:  # torch is imported only where tensors are built: reward worker processes never load it
    from torch import Tensor

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # reward.options.timeout_s: seconds one call may take, in every isolation mode
DEFAULT_SCORE_BOUND = 1e6  # reward.options.score_bound: |score| above it is malformed
_CUT_GRACE_S = 1.0  # how long an overrunning in-process call may take to unwind after it is cut


@dataclass(frozen=True)
class RewardResult:
    score: float  # +1 correct, -1 wrong or malformed (binary rewards by default)
    malformed: bool  # no answer could be read from the completion
    info: str = ""


RewardFn = Callable[[str, str, Any], Any]  # returns a RewardResult or a plain number


@dataclass
class RewardBatch:
    scores: "Tensor"  # [N] float
    malformed: "Tensor"  # [N] bool
    failures: int  # calls that raised, timed out or broke the contract (each scored as malformed)


class RewardHangError(RuntimeError):
    """A reward call overran `reward.options.timeout_s` and could not be cut: the run stopped after saving."""


class RewardContract:
    """Turns raw reward returns into a `RewardBatch`; what breaks the contract is malformed and counted."""

    def __init__(self, failure_score: float = -1.0, score_bound: float = DEFAULT_SCORE_BOUND):
        if not score_bound > 0:
            raise ValueError(f"reward.options.score_bound must be > 0, got {score_bound!r}")
        self.failure_score, self.score_bound = float(failure_score), float(score_bound)
        self._warned: set[str] = set()  # one warning per kind of violation, not one per call

    def failed(self, why: str) -> RewardResult:
        return RewardResult(self.failure_score, True, f"error: {why}")

    def check(self, value: Any) -> tuple[RewardResult, bool]:
        """(the result to use, whether `value` broke the contract)."""
        if isinstance(value, RewardResult):
            score = value.score
        elif isinstance(value, numbers.Real):  # float, int, bool, numpy scalars: TRL-style rewards
            score, value = value, RewardResult(float(value), False)
        else:
            return self._violation(f"returned {type(value).__name__}",
                                   "rewards return a float or a RewardResult"), True
        if not isinstance(score, numbers.Real):
            return self._violation(f"score of type {type(score).__name__}", "a score is a number"), True
        number = float(score)
        if not math.isfinite(number):
            return self._violation("non-finite score", f"score {score!r} is not a finite number"), True
        if abs(number) > self.score_bound:
            return self._violation("score out of bound", f"|score| {number:g} > reward.options.score_bound="
                                                         f"{self.score_bound:g}"), True
        return value, False

    def _violation(self, kind: str, detail: str) -> RewardResult:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("reward %s (%s): scored as malformed and counted in reward_failures; warned once",
                        kind, detail)
        return self.failed(f"{kind}: {detail}")

    def batch(self, values: Sequence[Any], failures: int) -> RewardBatch:
        """`failures`: calls that already failed (raised, timed out); contract violations are added."""
        import torch

        results = []
        for value in values:
            result, broken = self.check(value)
            results.append(result)
            failures += broken
        scores = torch.tensor([float(r.score) for r in results], dtype=torch.float32)  # [N]
        malformed = torch.tensor([bool(r.malformed) for r in results], dtype=torch.bool)  # [N]
        return RewardBatch(scores, malformed, failures)


class RewardRunner:
    """Scores completions in-process; each call bounded by `timeout_s` (see the module docstring).

    `stop_reason` is set (and stays set) once a call overran and could not be cut: its thread is abandoned,
    still running, so the run should stop (the module saves a checkpoint first).
    """

    def __init__(self, fn: RewardFn, failure_score: float = -1.0, timeout_s: float = DEFAULT_TIMEOUT_S,
                 score_bound: float = DEFAULT_SCORE_BOUND):
        if not timeout_s > 0:
            raise ValueError(f"reward.options.timeout_s must be > 0, got {timeout_s!r}")
        self.fn, self.timeout_s = fn, float(timeout_s)
        self.contract = RewardContract(failure_score, score_bound)
        self.failure_score = self.contract.failure_score
        self.stop_reason: Optional[str] = None
        self._thread: Optional[_CallThread] = None

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> RewardBatch:
        values, failures = [], 0
        for args in zip(prompts, completions, answers):
            value, error = self._call(args)
            if error is not None:  # reward code is user code: count the failure, keep training
                failures += 1
                log.warning("reward call failed: %s (scored as malformed)", error)
                value = self.contract.failed(error)
            values.append(value)
        return self.contract.batch(values, failures)

    def _call(self, args: tuple) -> tuple[Any, Optional[str]]:
        """(value, None) or (None, why it failed)."""
        if self._thread is None:
            self._thread = _CallThread()
        job = self._thread.submit(self.fn, args)
        if job.done.wait(self.timeout_s):
            return job.value, job.error
        thread, self._thread = self._thread, None  # never reused: a late cut could land in the next call
        thread.cut()
        if job.done.wait(_CUT_GRACE_S):
            return None, f"timeout after {self.timeout_s:g}s (reward.options.timeout_s)"
        self.stop_reason = (f"a reward call ran past reward.options.timeout_s={self.timeout_s:g} and could not be "
                            "cut in the training process (blocked outside Python code); run the reward with "
                            "reward.options.isolation=process (its workers can be killed), or raise "
                            "reward.options.timeout_s")
        return None, f"timeout after {self.timeout_s:g}s, not cut: the run stops after this step"

    def close(self) -> None:
        if self._thread is not None:
            self._thread.retire()
            self._thread = None


class _CallTimeout(BaseException):
    """Raised inside an overrunning reward call to cut it (a BaseException: `except Exception` lets it pass)."""


@dataclass
class _Job:
    fn: RewardFn
    args: tuple
    done: threading.Event
    value: Any = None
    error: Optional[str] = None


class _CallThread(threading.Thread):
    """Runs reward calls one after another; daemon, so an abandoned hung call never blocks the exit."""

    def __init__(self):
        super().__init__(name="reward-call", daemon=True)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._retired = False
        self.start()

    def submit(self, fn: RewardFn, args: tuple) -> _Job:
        job = _Job(fn, args, threading.Event())
        self._jobs.put(job)
        return job

    def retire(self) -> None:
        self._retired = True
        self._jobs.put(None)

    def cut(self) -> None:
        """Raise `_CallTimeout` in this thread at its next Python bytecode (not inside a blocking C call)."""
        self.retire()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(_CallTimeout))

    def run(self) -> None:
        while not self._retired:
            job = None
            try:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    job.value = job.fn(*job.args)
                except BaseException as err:  # SystemExit, KeyboardInterrupt too: the reward's, never the run's
                    job.error = f"{type(err).__name__}: {err}"
                job.done.set()
            except _CallTimeout:  # a cut that landed just after the call returned
                if job is not None:
                    job.done.set()


