"""Reward functions are plain callables: ``fn(prompt, completion, answer) -> RewardResult`` (or a plain number).

The contract, enforced on every result (the rule for each return type is in docs/rewards.md): a `RewardResult`
or one real number is a score. A number is a Python bool/int/float, any `numbers.Real` (e.g. a Fraction), a
`decimal.Decimal`, a numpy scalar (numpy.float32, numpy.bool_, ...) or a 0-d numpy array or torch tensor of a
bool, integer or floating dtype; `float()` of it is the score. Anything else (a str, None, a dict, a tensor with
a dimension, a complex number), a value that cannot become a finite float (10**400, NaN), a score outside
±`score_bound`, and a RewardResult whose score or `malformed` breaks these rules are malformed results, counted,
with one warning per kind. A reward that raises anything (SystemExit and KeyboardInterrupt included) is a
counted failure. Results are made plain (`plain_result`) where the call ran, inside its time bound, so the
trainer never calls into a returned object.

Every call gets its own deep copy of its arguments (in worker processes: its own unpickled copy), so a reward
that changes its prompt or answer cannot change what a later call, step or evaluation sees.

`Runner` is the base of every reward runner: the settings (`RunnerOptions`, lit_rlvr/rewards/options.py), the
contract, the failure loop and its counts, waits that honour a stop request, `stop_reason`. Its subclasses say how
calls run: `RewardRunner` here, in the training process, each call on a watchdog thread bounded by `timeout_s` (an
overrunning call is cut, an exception raised in its thread, and counted; a call that cannot be cut, blocked in C
code, is counted and sets `stop_reason`, on which the module saves a checkpoint and stops the run);
`ProcessRewardRunner` (workers.py) in worker processes that can always be killed; `AsyncRewardRunner`
(async_runner.py) on an event loop; `BatchRewardRunner` (batch.py) through a reward's own `score_batch`;
`TermsRunner` (terms.py) as a weighted sum of other runners.
"""

from __future__ import annotations

import copy
import ctypes
import decimal
import logging
import math
import numbers
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

from lit_rlvr.config.problems import convert
from lit_rlvr.rewards.options import DEFAULT_SCORE_BOUND, DEFAULT_TIMEOUT_S, RunnerOptions  # noqa: F401 (re-exported)
from lit_rlvr.run.stop import STOP

if TYPE_CHECKING:  # torch is imported only where tensors are built: reward worker processes never load it
    from torch import Tensor

log = logging.getLogger(__name__)

_STOP_POLL_S = 0.1  # how often a wait on a reward call looks at the stop request
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
    failed: Optional["Tensor"] = None  # [N] bool: which calls those were (failed.sum() == failures)
    skipped: Optional["Tensor"] = None  # [N] bool: returned None under `none_skips` (a term that does not score it)


@dataclass(frozen=True)
class Failure(RewardResult):
    """A call that raised, timed out or broke the contract (made by `RewardContract.failed`, never by a reward:
    `plain_result` turns every returned object into a plain `RewardResult`)."""


NONE_RETURNED = "returned NoneType"  # the breach of a reward that returned None (`none_skips` reads it as a skip)


@dataclass(frozen=True)
class ContractBreach:
    """A reward return that is not a score, described in plain strings (picklable; holds no returned object)."""

    kind: str  # warned once per kind, e.g. "returned str"
    detail: str


class _NotAScore(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(kind, detail)
        self.kind, self.detail = kind, detail


_MAX_INFO = 1000  # characters of RewardResult.info kept


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _scalar(value: Any, what: str) -> Any:
    """The plain Python bool/int/float/Real/Decimal that `value` is; numpy scalars and 0-d arrays or tensors
    through `.item()`. Raises `_NotAScore` for anything else."""
    if isinstance(value, (bool, numbers.Real, decimal.Decimal)) and not hasattr(value, "ndim"):
        return value
    ndim, item = getattr(value, "ndim", None), getattr(value, "item", None)
    name = type(value).__name__
    if ndim is not None and callable(item):  # numpy scalars and arrays, torch tensors (duck-typed: none imported)
        if ndim != 0:
            shape = tuple(getattr(value, "shape", ()))
            raise _NotAScore(f"{what} {name} with a dimension", f"shape {list(shape)}: one number per completion "
                                                                 "(a 0-d tensor, or call .item())")
        inner = item()
        if isinstance(inner, (bool, int, float)):
            return inner
        raise _NotAScore(f"{what} {name} of {type(inner).__name__}", "a score is a real number")
    raise _NotAScore(f"{what} {name}", "rewards return a number or a RewardResult (docs/rewards.md)")


def _number(value: Any, what: str) -> float:
    number = _scalar(value, what)
    try:
        return float(number)
    except (OverflowError, ValueError, TypeError) as err:  # 10**400, Decimal('sNaN')
        raise _NotAScore("score not a finite float", f"{_short(number)}: {type(err).__name__}: {err}") from None


def _flag(value: Any) -> bool:
    flag = _scalar(value, "RewardResult.malformed of type")
    if isinstance(flag, bool) or (isinstance(flag, numbers.Integral) and flag in (0, 1)):
        return bool(flag)
    raise _NotAScore("RewardResult.malformed not a bool", f"{_short(flag)}: malformed is True or False")


def plain_result(value: Any) -> "RewardResult | ContractBreach":
    """What a reward returned as a `RewardResult` of plain Python types, or the `ContractBreach`; never raises
    (a returned object whose conversion raises or misbehaves is a breach). Run where the call ran: in its time
    bound, and in its worker process under isolation=process."""
    try:
        if isinstance(value, ContractBreach):
            return value
        if isinstance(value, RewardResult):
            info = value.info if isinstance(value.info, str) else str(value.info)
            return RewardResult(_number(value.score, "RewardResult.score of type"), _flag(value.malformed),
                                info[:_MAX_INFO])
        return RewardResult(_number(value, "returned"), False)
    except _NotAScore as err:
        return ContractBreach(err.kind, err.detail)
    except _CallTimeout:  # the watchdog's cut landed here: the call is over either way
        raise
    except BaseException as err:  # a hostile __float__, .item() or __str__ (SystemExit included)
        return ContractBreach("score conversion raised", f"{type(err).__name__}: {str(err)[:200]}")


class RewardContract:
    """Turns raw reward returns into a `RewardBatch`; what breaks the contract is malformed and counted.

    `none_skips` (set on the terms of a weighted reward, lit_rlvr/rewards/terms.py): None is not a breach but
    "this term does not score this sample" (TRL's rule for multi-task data), marked in `RewardBatch.skipped`."""

    none_skips = False

    def __init__(self, failure_score: float = -1.0, score_bound: float = DEFAULT_SCORE_BOUND):
        failure_score = convert("reward.options.failure_score", failure_score, float)
        score_bound = convert("reward.options.score_bound", score_bound, float)
        if not score_bound > 0:
            raise ValueError(f"reward.options.score_bound must be > 0, got {score_bound!r}")
        self.failure_score, self.score_bound = failure_score, score_bound
        self._warned: set[str] = set()  # one warning per kind of violation, not one per call

    def failed(self, why: str) -> RewardResult:
        return Failure(self.failure_score, True, f"error: {why}")

    def check(self, value: Any) -> tuple[RewardResult, bool]:
        """(the result to use, whether `value` broke the contract)."""
        if isinstance(value, Failure):  # a failure already counted by the runner
            return value, False
        result = plain_result(value)
        if isinstance(result, ContractBreach):
            if self.none_skips and result.kind == NONE_RETURNED:
                return _SKIP, False
            return self._violation(result.kind, result.detail), True
        if not math.isfinite(result.score):
            return self._violation("non-finite score", f"score {result.score!r} is not a finite number"), True
        if abs(result.score) > self.score_bound:
            return self._violation("score out of bound", f"|score| {result.score:g} > reward.options.score_bound="
                                                         f"{self.score_bound:g}"), True
        return result, False

    def _violation(self, kind: str, detail: str) -> RewardResult:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("reward %s (%s): scored as malformed and counted in reward_failures; warned once",
                        kind, detail)
        return self.failed(f"{kind}: {detail}")

    def batch(self, values: Sequence[Any], failures: int) -> RewardBatch:
        """`failures`: calls that already failed (raised, timed out); contract violations are added."""
        import torch

        results, failed = [], []
        for value in values:
            result, broken = self.check(value)
            results.append(result)
            failures += broken
            failed.append(broken or isinstance(value, Failure))
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)  # [N]
        malformed = torch.tensor([r.malformed for r in results], dtype=torch.bool)  # [N]
        skipped = torch.tensor([r is _SKIP for r in results], dtype=torch.bool)  # [N]
        return RewardBatch(scores, malformed, failures, torch.tensor(failed, dtype=torch.bool), skipped)


_SKIP = RewardResult(0.0, False, "skipped: returned None")


def copied(args: tuple) -> tuple:
    """A deep copy of one call's (prompt, completion, answer): what the reward does to it stays in that call."""
    return copy.deepcopy(args)


class CallError(NamedTuple):
    """A call that failed before it returned: `kind` says which way (warned once per kind), `why` the details."""

    kind: str
    why: str


Outcome = Any  # what one call gave: a plain result, a `ContractBreach`, a `Failure`, or a `CallError`


def wait_or_stop(ready: Callable[[float], bool], timeout_s: Optional[float]) -> bool:
    """Whether `ready(seconds)` (a wait of at most that long) said yes within `timeout_s` (None: no bound); between
    short waits, a stop request older than its grace raises `StopRequested` (lit_rlvr/run/stop.py), so no wait of the
    trainer on a reward call defers a stop past `stop_grace_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        STOP.check()
        left = math.inf if deadline is None else deadline - time.monotonic()
        if ready(max(0.0, min(left, _STOP_POLL_S))):
            return True
        if left <= _STOP_POLL_S:
            return False


class Runner:
    """The base of every reward runner: `runner(prompts, completions, answers) -> RewardBatch`.

    It owns what every runner shares: its settings (`RunnerOptions`), the contract (`RewardContract`: what a
    reward may return), the failure loop (a call that raised, timed out or broke the contract is scored
    `failure_score`, malformed, counted in `RewardBatch.failures`, and warned once per kind), the waits (each
    honours a stop request: `wait_or_stop`) and `stop_reason` (set once a call ran past its bound and could not be
    ended: the run saves and stops after the step). A subclass says how the calls run: `_score(jobs)` returns one
    outcome per job, in order.
    """

    stop_reason: Optional[str] = None

    def __init__(self, fn: Any, options: Optional[RunnerOptions] = None, *, failure_score: float = -1.0,
                 **settings: Any):
        options = options or RunnerOptions()
        self.options = options.replace(**settings) if settings else options
        self.fn, self.timeout_s = fn, self.options.timeout_s
        self.contract = RewardContract(failure_score, self.options.score_bound)
        self.failure_score = self.contract.failure_score
        self._warned: set[str] = set()

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any]) -> RewardBatch:
        jobs = list(zip(prompts, completions, answers))
        outcomes = self._score(jobs) if jobs else []
        values = [self._failed(o) if isinstance(o, CallError) else o for o in outcomes]
        return self.contract.batch(values, sum(isinstance(v, Failure) for v in values))

    def _score(self, jobs: list[tuple]) -> list[Outcome]:
        raise NotImplementedError

    def _failed(self, error: CallError) -> RewardResult:
        if error.kind not in self._warned:
            self._warned.add(error.kind)
            log.warning("reward call failed: %s (scored as malformed and counted in reward_failures; later "
                        "failures of this kind are counted, not logged)", error.why)
        return self.contract.failed(error.why)

    def close(self) -> None:
        """Ends what the runner started (threads, processes, a loop); a later call starts them again."""

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RewardRunner(Runner):
    """Scores completions in-process, one call after another on a watchdog thread, each bounded by `timeout_s`
    (see the module docstring).

    `stop_reason` is set (and stays set) once a call overran and could not be cut: its thread is abandoned, still
    running, so the run should stop (the module saves a checkpoint first). From then on the calls left run side by
    side, each on a fresh thread, under one shared deadline: a batch whose every call blocks costs one more
    `timeout_s`, not one per call.
    """

    def __init__(self, fn: RewardFn, options: Optional[RunnerOptions] = None, **settings: Any):
        super().__init__(fn, options, **settings)
        self._thread: Optional[_CallThread] = None

    def _score(self, jobs: list[tuple]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for i, args in enumerate(jobs):
            if self.stop_reason is not None:
                return outcomes + self._side_by_side(jobs[i:])
            outcomes.append(self._call(args))
        return outcomes

    def _call(self, args: tuple) -> Outcome:
        try:
            args = copied(args)
        except Exception as err:
            return CallError("arguments not copied", f"its arguments cannot be copied ({type(err).__name__}: {err})")
        if self._thread is None:
            self._thread = _CallThread()
        job = self._thread.submit(self.fn, args)
        try:
            if wait_or_stop(job.done.wait, self.timeout_s):
                return job.outcome
        except BaseException:  # StopRequested: the call under way is left to its daemon thread
            self.close()
            raise
        thread, self._thread = self._thread, None  # never reused: a late cut could land in the next call
        thread.cut()
        if wait_or_stop(job.done.wait, _CUT_GRACE_S):
            return CallError("timeout", f"timeout after {self.timeout_s:g}s (reward.options.timeout_s)")
        return self._not_cut()

    def _side_by_side(self, jobs: list[tuple]) -> list[Outcome]:
        """Each call on a thread of its own, all under one deadline; those still running then are cut."""
        started: list[Any] = []
        for args in jobs:
            try:
                args = copied(args)
            except Exception as err:
                started.append(CallError("arguments not copied", f"its arguments cannot be copied ({err!r:.200})"))
                continue
            started.append(_CallThread().submit(self.fn, args, last=True))
        calls = [job for job in started if isinstance(job, _Job)]
        deadline = time.monotonic() + self.timeout_s
        for job in calls:
            wait_or_stop(job.done.wait, max(0.0, deadline - time.monotonic()))
        for job in calls:
            if not job.done.is_set():
                job.thread.cut()
        deadline = time.monotonic() + _CUT_GRACE_S
        for job in calls:
            wait_or_stop(job.done.wait, max(0.0, deadline - time.monotonic()))
        outcomes: list[Outcome] = []
        for job in started:
            if not isinstance(job, _Job):  # its arguments could not be copied
                outcomes.append(job)
            elif not job.done.is_set():
                outcomes.append(self._not_cut())
            elif job.cut:
                outcomes.append(CallError("timeout", f"timeout after {self.timeout_s:g}s (reward.options.timeout_s)"))
            else:
                outcomes.append(job.outcome)
        return outcomes

    def _not_cut(self) -> CallError:
        self.stop_reason = (f"a reward call ran past reward.options.timeout_s={self.timeout_s:g} and could not be "
                            "cut in the training process (blocked outside Python code); run the reward with "
                            "reward.options.isolation=process (its workers can be killed), or raise "
                            "reward.options.timeout_s")
        return CallError("not cut", f"timeout after {self.timeout_s:g}s, not cut: the run stops after this step")

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
    thread: "_CallThread"
    value: Any = None
    error: Optional[str] = None
    cut: bool = False  # the cut landed in this job (it ended by the watchdog, not by itself)

    @property
    def outcome(self) -> Outcome:
        return self.value if self.error is None else CallError("raised " + self.error.split(":", 1)[0], self.error)


class _CallThread(threading.Thread):
    """Runs reward calls one after another; daemon, so an abandoned hung call never blocks the exit."""

    def __init__(self):
        super().__init__(name="reward-call", daemon=True)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def submit(self, fn: RewardFn, args: tuple, last: bool = False) -> _Job:
        """Queue one call; `last`: the thread ends after it."""
        job = _Job(fn, args, threading.Event(), self)
        self._jobs.put(job)
        if last:
            self.retire()
        return job

    def retire(self) -> None:
        """End the thread after the jobs queued so far."""
        self._jobs.put(None)

    def cut(self) -> None:
        """Raise `_CallTimeout` in this thread at its next Python bytecode (not inside a blocking C call)."""
        self.retire()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(_CallTimeout))

    def run(self) -> None:
        while True:
            job = None
            try:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    job.value = plain_result(job.fn(*job.args))  # in the call's time bound
                except _CallTimeout:
                    job.cut = True
                except BaseException as err:  # SystemExit, KeyboardInterrupt too: the reward's, never the run's
                    job.error = f"{type(err).__name__}: {err}"
                job.done.set()
            except _CallTimeout:  # a cut that landed just after the call returned
                if job is not None:
                    job.cut = True
                    job.done.set()
                return
