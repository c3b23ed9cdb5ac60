"""`ProcessRewardRunner`: reward calls in worker processes, each call bounded in time; a hung or crashed call
costs one malformed, counted rollout, and only its own worker is replaced.

Why not `ProcessPoolExecutor`: it cannot cancel a running call, so a timeout meant killing and rebuilding the
whole pool, and Python 3.11's forkserver does not preload `__main__`, so each new worker re-imported train.py
(Lightning, torch): 6-30 s per timeout. Here a worker is a fresh `python -c _WORKER_SRC` that imports the stdlib,
`lit_rlvr.rewards.base` (no torch) and the reward's module only; a hung one is killed and a new one started at
once, while the other workers go on. Workers die with the trainer however it ends: PR_SET_PDEATHSIG (Linux) and a
thread that watches the parent pid; they ignore SIGINT/SIGTERM (the trainer decides when to stop, then kills them).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Sequence

from lit_rlvr.rewards.base import DEFAULT_SCORE_BOUND, DEFAULT_TIMEOUT_S, RewardBatch, RewardContract, RewardFn

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often running calls are checked against their deadline
_START_TIMEOUT_S = 120.0  # a worker not ready by then: the reward's module cannot be imported in time
_MAX_START_FAILURES = 3  # workers in a row that died before they were ready, before giving up

# The worker: stdin/stdout carry pickled messages; the reward's own prints go to stderr.
_WORKER_SRC = r'''
import os, pickle, signal, sys, threading, time
from multiprocessing.connection import Connection


def die_with(parent):
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL when the trainer dies
    except Exception:
        pass  # not Linux: the watcher below still ends this process (unless a call holds the GIL)
    if os.getppid() != parent:
        os._exit(1)  # the trainer died before the death signal was set

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main():
    die_with(int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is for the trainer
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox, outbox = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)  # print() in a reward must not corrupt the messages
    path, payload, main_path = inbox.recv()
    sys.path[:] = path
    if main_path:  # the reward lives in the trainer's __main__
        from multiprocessing import spawn
        spawn.import_main_path(main_path)
    fn = pickle.loads(payload)
    outbox.send(("ready", None, None))
    while True:
        try:
            index, args = inbox.recv()
        except EOFError:
            return
        try:
            message = ("ok", index, fn(*args))
        except BaseException as err:  # SystemExit, KeyboardInterrupt too: contained as the call's failure
            message = ("error", index, f"{type(err).__name__}: {err}")
        try:
            outbox.send(message)
        except Exception as err:
            outbox.send(("error", index, f"the result ({type(message[2]).__name__}) cannot be pickled: {err}"))


main()
'''


class _Worker:
    """One worker process and its two pipes; `index` is the call it runs (None when idle)."""

    def __init__(self, init: tuple):
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_SRC, str(os.getpid())], stdin=to_r,
                                     stdout=from_w, close_fds=True)
        os.close(to_r)
        os.close(from_w)
        self.inbox, self.outbox = Connection(to_w, readable=False), Connection(from_r, writable=False)
        self.ready, self.index, self.since = False, None, time.monotonic()
        self.inbox.send(init)

    def run(self, index: int, args: tuple) -> None:
        self.inbox.send((index, args))
        self.index, self.since = index, time.monotonic()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.inbox.close()
        self.outbox.close()


class ProcessRewardRunner:
    """Scores completions in `workers` worker processes; each call is bounded by `timeout_s` seconds.

    A call still running `timeout_s` after it was sent to a ready worker, or whose worker died (e.g. `os._exit`,
    segfault, out of memory), is scored `failure_score`, malformed, and counted in `failures`; that worker
    is killed and replaced. Workers start on the first call and live until `close()` (or the end of a `with`
    block). `fn` must be picklable: a module-level function or an instance of a module-level class.
    """

    def __init__(self, fn: RewardFn, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 2,
                 failure_score: float = -1.0, score_bound: float = DEFAULT_SCORE_BOUND):
        if not timeout_s > 0:
            raise ValueError(f"ProcessRewardRunner: timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"ProcessRewardRunner: workers must be >= 1, got {workers}")
        try:
            payload = pickle.dumps(fn)
        except Exception as err:
            raise TypeError(f"ProcessRewardRunner: the reward {fn!r} cannot be pickled for worker processes; "
                            f"use a module-level function or class instance ({err})") from err
        main = sys.modules.get("__main__")
        main_path = getattr(main, "__file__", None) if getattr(fn, "__module__", None) == "__main__" else None
        self._init = (list(sys.path), payload, main_path)
        self.fn, self.timeout_s, self.workers = fn, float(timeout_s), int(workers)
        self.contract = RewardContract(failure_score, score_bound)
        self.failure_score = self.contract.failure_score
        self._pool: list[_Worker] = []
        self._start_failures = 0  # workers in a row that died before they were ready

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> RewardBatch:
        jobs = list(zip(prompts, completions, answers))
        results: list[Any] = [None] * len(jobs)
        todo, failures = deque(range(len(jobs))), 0
        try:
            while todo or any(w.index is not None for w in self._pool):
                self._fill_pool()
                for worker in self._pool:
                    if todo and worker.ready and worker.index is None:
                        index = todo.popleft()
                        worker.run(index, jobs[index])
                for conn in wait([w.outbox for w in self._pool], timeout=_POLL_S):
                    failures += self._receive(next(w for w in self._pool if w.outbox is conn), results)
                failures += self._check_deadlines(results)
        except BaseException:  # e.g. KeyboardInterrupt: leave no call of this batch running
            self.close()
            raise
        return self.contract.batch(results, failures)

    def close(self) -> None:
        """Stops the workers (a later call starts new ones)."""
        pool, self._pool = self._pool, []
        for worker in pool:
            worker.kill()

    def __enter__(self) -> "ProcessRewardRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _fill_pool(self) -> None:
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self._init))

    def _receive(self, worker: _Worker, results: list) -> int:
        """Handle one message of `worker` (or its death); the number of failed calls (0 or 1)."""
        try:
            kind, index, value = worker.outbox.recv()
        except (EOFError, OSError):
            return self._on_death(worker, results)
        if kind == "ready":
            worker.ready, self._start_failures = True, 0
            return 0
        worker.index = None
        if kind == "ok":
            results[index] = value
            return 0
        results[index] = self._failed(index, value)
        return 1

    def _on_death(self, worker: _Worker, results: list) -> int:
        index, code = worker.index, worker.proc.wait()
        self._replace(worker)
        if index is not None:
            results[index] = self._failed(index, f"worker crashed (exit code {code})")
            return 1
        if not worker.ready:
            self._start_failures += 1
            if self._start_failures > _MAX_START_FAILURES:
                raise RuntimeError(f"ProcessRewardRunner: reward workers die while starting (exit code {code}); "
                                   "can the reward's module be imported in a fresh process? (its error is above)")
            log.warning("a reward worker died while starting (exit code %s); starting another", code)
        return 0

    def _check_deadlines(self, results: list) -> int:
        now, failures = time.monotonic(), 0
        for worker in list(self._pool):
            if worker.index is not None and now - worker.since > self.timeout_s:
                results[worker.index] = self._failed(worker.index, f"timeout after {self.timeout_s:g}s "
                                                                   "(reward.options.timeout_s)")
                failures += 1
                self._replace(worker)
            elif not worker.ready and now - worker.since > _START_TIMEOUT_S:
                raise RuntimeError(f"ProcessRewardRunner: a reward worker was not ready within "
                                   f"{_START_TIMEOUT_S:g}s (importing the reward's module)")
        return failures

    def _replace(self, worker: _Worker) -> None:
        """Kill one worker (the only way to stop a call stuck in C code) and start its successor now."""
        worker.kill()
        self._pool[self._pool.index(worker)] = _Worker(self._init)

    def _failed(self, index: int, why: str) -> Any:
        log.warning("reward call %d failed: %s (scored as malformed)", index, why)
        return self.contract.failed(why)
