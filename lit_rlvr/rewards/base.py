"""Reward functions are plain callables: ``fn(prompt, completion, answer) -> RewardResult``.

`RewardRunner` scores a batch in-process and never lets a reward failure kill the run: an exception makes
that rollout malformed and is counted. `ProcessRewardRunner` does the same in a pool of worker processes and
also bounds every call in time: a timeout or a crashed worker is one malformed, counted rollout.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import pickle
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardResult:
    score: float  # +1 correct, -1 wrong or malformed (binary rewards by default)
    malformed: bool  # no answer could be read from the completion
    info: str = ""


RewardFn = Callable[[str, str, Any], RewardResult]


@dataclass
class RewardBatch:
    scores: Tensor  # [N] float
    malformed: Tensor  # [N] bool
    failures: int  # calls that raised or timed out (each scored as malformed)


class RewardRunner:
    """Scores completions in-process; a raising reward gives `failure_score` and malformed."""

    def __init__(self, fn: RewardFn, failure_score: float = -1.0):
        self.fn = fn
        self.failure_score = failure_score

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> RewardBatch:
        results, failures = [], 0
        for prompt, completion, answer in zip(prompts, completions, answers):
            try:
                result = self.fn(prompt, completion, answer)
            except Exception as err:  # reward code is user code: count the failure, keep training
                failures += 1
                log.warning("reward function raised %s: %s (scored as malformed)", type(err).__name__, err)
                result = RewardResult(self.failure_score, True, f"error: {err}")
            results.append(result)
        return _to_batch(results, failures, self.failure_score)

    def close(self) -> None:
        pass


def _to_batch(results: Sequence[RewardResult], failures: int, failure_score: float) -> RewardBatch:
    """The batch tensors; a score that is not a finite number is a broken reward: `failure_score`, malformed and
    counted, like a raise (a NaN would otherwise reach the advantages and the V0.5 context)."""
    results = list(results)
    for i, r in enumerate(results):
        try:
            ok = math.isfinite(float(r.score))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            failures += 1
            log.warning("reward returned score %r (scored as malformed)", r.score)
            results[i] = RewardResult(failure_score, True, f"error: score {r.score!r} is not a finite number")
    scores = torch.tensor([float(r.score) for r in results])  # [N]
    malformed = torch.tensor([bool(r.malformed) for r in results], dtype=torch.bool)  # [N]
    return RewardBatch(scores, malformed, failures)


# ------------------------------------------------------------------------------------------------------
# Process isolation: each call bounded in time; a hang or a crash costs one rollout, never the run.

_POLL_S = 0.05  # how often the parent checks running calls against their deadline
_START_TIMEOUT_S = 120.0  # a submitted call no worker picked up by then: the pool is stuck starting
_MAX_POOL_RESTARTS = 3  # pool deaths in a row that no call can be blamed for, before giving up

_worker_fn: RewardFn | None = None
_worker_started: Any = None


def _init_worker(fn: RewardFn, started: Any) -> None:
    global _worker_fn, _worker_started
    _worker_fn, _worker_started = fn, started


def _run_in_worker(index: int, prompt: str, completion: str, answer: Any) -> RewardResult:
    # Runs in the worker's main thread, so rewards may use signal-based timeouts (math-verify does).
    _worker_started.put(index)  # the call's clock starts now: worker start-up time is not counted
    return _worker_fn(prompt, completion, answer)


@dataclass
class _Batch:
    """Book-keeping of one `ProcessRewardRunner` call; indices refer to `jobs`."""

    jobs: list[tuple[str, str, Any]]
    results: list[RewardResult | None]
    todo: deque  # indices to run, one per worker
    suspects: deque = field(default_factory=deque)  # in flight at a crash: rerun alone
    blamed_once: set = field(default_factory=set)  # indices that were in flight at a crash
    running: dict = field(default_factory=dict)  # Future -> index
    submitted: dict = field(default_factory=dict)  # index -> time it was submitted
    started: dict = field(default_factory=dict)  # index -> time a worker began it
    failures: int = 0
    restarts: int = 0  # pool deaths in a row that no call could be blamed for


class ProcessRewardRunner:
    """Scores completions in a pool of worker processes; each call is bounded by `timeout_s` seconds.

    A call still running `timeout_s` after a worker started it, or whose worker died (e.g. `os._exit`,
    segfault, out of memory), is scored `failure_score`, malformed, and counted in `failures`. The stuck
    pool is killed and rebuilt; the calls that were in flight beside it are rerun. After a crash, the calls
    that were in flight rerun one at a time, so only the one that crashes again is blamed.

    Workers start on the first call (the `forkserver` server imports the reward's module once, so a rebuild
    is cheap) and live until `close()` (or the end of a `with` block). `fn` must be picklable: a module-level
    function or an instance of a module-level class.
    """

    def __init__(self, fn: RewardFn, timeout_s: float = 5.0, workers: int = 2, failure_score: float = -1.0,
                 start_method: str | None = None):
        if timeout_s <= 0:
            raise ValueError(f"ProcessRewardRunner: timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"ProcessRewardRunner: workers must be >= 1, got {workers}")
        try:
            pickle.dumps(fn)
        except Exception as err:
            raise TypeError(f"ProcessRewardRunner: the reward {fn!r} cannot be pickled for worker processes; "
                            f"use a module-level function or class instance ({err})") from err
        methods = mp.get_all_start_methods()
        self.start_method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
        if self.start_method == "fork":
            raise ValueError("ProcessRewardRunner: start_method='fork' is unsafe with threads; use forkserver or spawn")
        self.fn, self.timeout_s, self.workers, self.failure_score = fn, float(timeout_s), int(workers), failure_score
        self._pool: ProcessPoolExecutor | None = None
        self._started: Any = None  # queue on which workers announce the call they begin

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> RewardBatch:
        jobs = list(zip(prompts, completions, answers))
        b = _Batch(jobs, [None] * len(jobs), deque(range(len(jobs))))
        try:
            while b.todo or b.suspects or b.running:
                self._fill(b)
                done, _ = wait(b.running, timeout=_POLL_S, return_when=FIRST_COMPLETED)
                self._drain_started(b.started)
                if self._collect(b, done):
                    self._on_crash(b)
                else:
                    self._check_deadlines(b)
        except BaseException:  # e.g. KeyboardInterrupt: leave no call of this batch running in the pool
            self._kill_pool()
            raise
        return _to_batch(b.results, b.failures, self.failure_score)

    def close(self) -> None:
        """Stops the workers (a later call starts new ones)."""
        self._kill_pool()

    def __enter__(self) -> "ProcessRewardRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _fill(self, b: _Batch) -> None:
        """Keep one call per worker in flight (so a submitted call starts at once); a suspect runs alone."""
        while b.suspects and not b.running:
            self._submit(b, b.suspects.popleft())
        while not b.suspects and b.todo and len(b.running) < self.workers:
            self._submit(b, b.todo.popleft())

    def _submit(self, b: _Batch, index: int) -> None:
        try:
            future = self._ensure_pool().submit(_run_in_worker, index, *b.jobs[index])
        except BrokenProcessPool:  # an idle worker died since the last look: start over on a fresh pool
            self._requeue(b, failed=set())
            future = self._ensure_pool().submit(_run_in_worker, index, *b.jobs[index])
        b.running[future] = index
        b.submitted[index] = time.monotonic()
        b.started.pop(index, None)

    def _collect(self, b: _Batch, done: set) -> bool:
        """Store finished results; True when the pool broke (the broken calls stay in `b.running`)."""
        broken = False
        for future in done:
            index = b.running.pop(future)
            try:
                b.results[index] = future.result()
            except BrokenProcessPool:
                broken, b.running[future] = True, index
            except KeyboardInterrupt:
                raise
            except BaseException as err:  # the reward raised inside the worker: same as RewardRunner
                b.failures += 1
                b.results[index] = self._failed(index, f"error: {type(err).__name__}: {err}")
        return broken

    def _on_crash(self, b: _Batch) -> None:
        """A worker died. Blame a call only if it already was in flight at a crash (so it ran alone)."""
        in_flight = set(b.running.values())
        if not any(i in b.started for i in in_flight):  # died before running anything: not the reward's fault
            b.restarts += 1
            if b.restarts > _MAX_POOL_RESTARTS:
                raise RuntimeError("ProcessRewardRunner: reward workers keep dying before running a call; "
                                   "can the reward's module be imported in a fresh process?")
            log.warning("reward worker pool died while starting; restarting it")
            self._requeue(b, failed=set())
            return
        guilty = in_flight & b.blamed_once
        for index in guilty:
            b.results[index] = self._failed(index, "worker crashed")
        b.failures, b.restarts = b.failures + len(guilty), 0
        b.blamed_once |= in_flight
        self._requeue(b, failed=guilty)

    def _check_deadlines(self, b: _Batch) -> None:
        now = time.monotonic()
        stuck = {i for i in b.running.values() if now - b.started.get(i, now) > self.timeout_s}
        if stuck:
            for index in stuck:
                b.results[index] = self._failed(index, f"timeout after {self.timeout_s:g}s")
            b.failures += len(stuck)
            self._requeue(b, failed=stuck)
        elif any(i not in b.started and now - b.submitted[i] > _START_TIMEOUT_S for i in b.running.values()):
            raise RuntimeError(f"ProcessRewardRunner: no worker started a call within {_START_TIMEOUT_S:g}s")

    def _requeue(self, b: _Batch, failed: set) -> None:
        """Kill the pool (the only way to stop a call stuck in C code); rerun the other calls in flight."""
        others = sorted(set(b.running.values()) - failed)
        b.running.clear()
        self._kill_pool()
        b.suspects.extendleft(i for i in reversed(others) if i in b.blamed_once)
        b.todo.extendleft(i for i in reversed(others) if i not in b.blamed_once)

    def _failed(self, index: int, why: str) -> RewardResult:
        log.warning("reward call %d failed: %s (scored as malformed)", index, why)
        return RewardResult(self.failure_score, True, why)

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx = mp.get_context(self.start_method)
            if self.start_method == "forkserver":  # (process-wide setting; no effect once the server runs)
                ctx.set_forkserver_preload(["__main__", __name__, getattr(self.fn, "__module__", __name__)])
            self._started = ctx.SimpleQueue()
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                             initargs=(self.fn, self._started))
        return self._pool

    def _drain_started(self, started: dict[int, float]) -> None:
        while self._started is not None and not self._started.empty():
            started.setdefault(self._started.get(), time.monotonic())

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # ProcessPoolExecutor cannot cancel a running call; killing its processes is the supported way out.
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for process in processes:
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(timeout=5.0)
        self._started.close()
        self._started = None
