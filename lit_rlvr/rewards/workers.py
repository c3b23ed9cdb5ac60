"""`ProcessRewardRunner`: reward calls in worker processes, each call bounded in time; a hung or crashed call
costs one malformed, counted rollout, and only its own worker is replaced.

Why not `ProcessPoolExecutor`: it cannot cancel a running call, so a timeout meant killing and rebuilding the
whole pool, and Python 3.11's forkserver does not preload `__main__`, so each new worker re-imported train.py
(Lightning, torch): 6-30 s per timeout. Here a small "zygote" process (`python -c _ZYGOTE_SRC`: the stdlib,
`lit_rlvr.rewards.base` without torch, and the reward's module) imports the reward once and forks a worker per
request in milliseconds; a hung worker is killed and a fork replaces it while the others go on.

Workers die with the trainer however it ends: the zygote and each worker set PR_SET_PDEATHSIG (Linux) on their
parent (for the zygote: the trainer thread that made the first call, so call the runner from a lasting
thread); the zygote also exits when its socket to the trainer closes, and a worker thread watches its parent's
pid. They ignore SIGINT/SIGTERM: the trainer decides when to stop, then kills them.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

from lit_rlvr.rewards.base import CallError, RewardFn, Runner
from lit_rlvr.rewards.options import RunnerOptions
from lit_rlvr.run.stop import STOP

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often running calls are checked against their deadline
_START_TIMEOUT_S = 120.0  # the zygote not ready by then: the reward's module cannot be imported in time
_MAX_START_FAILURES = 3  # zygotes in a row that died before they were ready, before giving up

_ZYGOTE_SRC = r'''
import os, pickle, signal, socket, struct, sys, threading, time
from multiprocessing.connection import Connection


def die_with(parent, watch):
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL when the parent dies
    except Exception:
        pass  # not Linux: the watcher thread (or, in the zygote, its socket's EOF) ends this process
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the death signal was set

    def watcher():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if watch:
        threading.Thread(target=watcher, daemon=True).start()


def serve(fn, inbox, outbox):
    from lit_rlvr.rewards.base import plain_result  # the trainer receives plain numbers, never a returned object

    while True:
        try:
            index, args = inbox.recv()  # a fresh unpickled copy: a reward that changes it changes only this call
        except EOFError:
            return
        try:
            message = ("ok", index, plain_result(fn(*args)))
        except BaseException as err:  # SystemExit, KeyboardInterrupt too: contained as the call's failure
            message = ("error", index, f"{type(err).__name__}: {str(err)[:1000]}")
        try:
            outbox.send(message)
        except Exception as err:
            outbox.send(("error", index, f"the result ({type(message[2]).__name__}) cannot be pickled: {err}"))


def fork_worker(sock, fn):
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            sock.close()
            os.close(to_w)
            os.close(from_r)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the reward may wait for its own children
            die_with(zygote, watch=True)
            serve(fn, Connection(to_r, writable=False), Connection(from_w, readable=False))
        finally:
            os._exit(0)
    os.close(to_r)
    os.close(from_w)
    socket.send_fds(sock, [struct.pack("q", pid)], [to_w, from_r])
    os.close(to_w)
    os.close(from_r)


def main():
    die_with(int(sys.argv[1]), watch=False)  # no thread here: this process forks
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # Ctrl-C in the terminal is for the trainer
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    os.dup2(2, 1)  # print() in a reward goes to stderr
    sock = socket.socket(fileno=int(sys.argv[2]))
    path, payload, main_path = Connection(os.dup(sock.fileno())).recv()
    sys.path[:] = path
    if main_path:  # the reward lives in the trainer's __main__
        from multiprocessing import spawn
        spawn.import_main_path(main_path)
    fn = pickle.loads(payload)
    sock.sendall(b"R")
    while sock.recv(1) == b"F":  # b"" when the trainer is gone
        fork_worker(sock, fn)


main()
'''


class _Zygote:
    """The process that holds the imported reward and forks workers."""

    def __init__(self, init: tuple):
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE_SRC, str(os.getpid()), str(theirs.fileno())],
                                     stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()
        conn = Connection(os.dup(self.sock.fileno()))
        conn.send(init)
        conn.close()
        self.sock.settimeout(_START_TIMEOUT_S)
        try:
            ready = self.sock.recv(1) == b"R"
        except socket.timeout:
            self.kill()
            raise RuntimeError(f"ProcessRewardRunner: the reward worker process was not ready within "
                               f"{_START_TIMEOUT_S:g}s (importing the reward's module)") from None
        self.sock.settimeout(30.0)
        if not ready:
            self.kill()
            raise ConnectionError(f"exit code {self.proc.returncode}")

    def fork(self) -> "_Worker":
        self.sock.sendall(b"F")
        data, fds, _, _ = socket.recv_fds(self.sock, 8, 2)
        if len(fds) != 2:
            raise ConnectionError("the zygote sent no worker")
        return _Worker(struct.unpack("q", data)[0], *fds)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.sock.close()


class _Worker:
    """One forked worker and its two pipes; `index` is the call it runs (None when idle)."""

    def __init__(self, pid: int, to_w: int, from_r: int):
        self.pid, self.inbox, self.outbox = pid, Connection(to_w, readable=False), Connection(from_r, writable=False)
        self.index, self.since = None, time.monotonic()

    def run(self, index: int, args: tuple) -> None:
        self.inbox.send((index, args))
        self.index, self.since = index, time.monotonic()

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # the zygote reaps it
        except ProcessLookupError:
            pass
        self.inbox.close()
        self.outbox.close()


class ProcessRewardRunner(Runner):
    """Scores completions in `workers` worker processes; each call is bounded by `timeout_s` seconds.

    A call still running `timeout_s` after it was sent to its worker, or whose worker died (e.g. `os._exit`,
    segfault, out of memory), is scored `failure_score`, malformed, and counted in `failures`; that worker
    is killed and replaced. Workers start on the first call and live until `close()` (or the end of a `with`
    block). `fn` must be picklable: a module-level function or an instance of a module-level class.
    `stop_reason` is never set: an overrunning call's worker is killed, so the run goes on.
    """

    def __init__(self, fn: RewardFn, options: Optional[RunnerOptions] = None, **settings: Any):
        super().__init__(fn, options, **settings)
        self.workers = self.options.workers
        try:
            payload = pickle.dumps(fn)
        except Exception as err:
            raise TypeError(f"ProcessRewardRunner: the reward {fn!r} cannot be pickled for worker processes; "
                            f"use a module-level function or class instance ({err})") from err
        main = sys.modules.get("__main__")
        main_path = getattr(main, "__file__", None) if getattr(fn, "__module__", None) == "__main__" else None
        self._init = (list(sys.path), payload, main_path)
        self._zygote: Optional[_Zygote] = None
        self._pool: list[_Worker] = []

    def _score(self, jobs: list[tuple]) -> list[Any]:
        results: list[Any] = [None] * len(jobs)
        todo = deque(range(len(jobs)))
        try:
            while todo or any(w.index is not None for w in self._pool):
                STOP.check()  # a stop request past its grace: the workers are killed below
                while len(self._pool) < self.workers:
                    self._pool.append(self._fork())
                for worker in list(self._pool):
                    if todo and worker.index is None:
                        self._start(worker, todo, jobs, results)
                for conn in wait([w.outbox for w in self._pool], timeout=_POLL_S):
                    self._receive(next(w for w in self._pool if w.outbox is conn), results)
                self._check_deadlines(results)
        except BaseException:  # e.g. KeyboardInterrupt, StopRequested: leave no call of this batch running
            self.close()
            raise
        return results

    def close(self) -> None:
        """Stops the workers (a later call starts new ones)."""
        pool, self._pool = self._pool, []
        for worker in pool:
            worker.kill()
        if self._zygote is not None:
            self._zygote.kill()
            self._zygote = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _fork(self) -> _Worker:
        """A new worker from the zygote; a dead zygote is restarted (a few times in a row at most)."""
        for attempt in range(_MAX_START_FAILURES + 1):
            try:
                if self._zygote is None:
                    self._zygote = _Zygote(self._init)
                return self._zygote.fork()
            except (ConnectionError, OSError, struct.error) as err:
                if self._zygote is not None:
                    self._zygote.kill()
                    self._zygote = None
                log.warning("the reward worker process died (%s); starting another", err)
        raise RuntimeError("ProcessRewardRunner: the reward worker process keeps dying while starting; can the "
                           "reward's module be imported in a fresh process? (its error is above)")

    def _start(self, worker: _Worker, todo: deque, jobs: list, results: list) -> None:
        """Send the next call to `worker`."""
        index = todo.popleft()
        try:
            worker.run(index, jobs[index])
        except OSError:  # the idle worker died since the last look (e.g. the OOM killer): not the call's fault
            todo.appendleft(index)
            self._replace(worker)
        except Exception as err:  # arguments that cannot be pickled: nothing was sent, the worker stays idle
            results[index] = CallError("arguments not sent", f"its arguments cannot be sent to a worker ({err!r:.200})")

    def _receive(self, worker: _Worker, results: list) -> None:
        """Handle one message of `worker` (or its death)."""
        try:
            kind, index, value = worker.outbox.recv()
        except Exception as err:  # died (EOFError, OSError), or wrote something that is not a result message
            index = worker.index
            self._replace(worker)
            if index is not None:
                crashed = isinstance(err, (EOFError, OSError))
                results[index] = CallError("worker crashed", "worker crashed") if crashed else \
                    CallError("unreadable result", f"unreadable result ({err!r:.200})")
            return
        worker.index = None
        results[index] = value if kind == "ok" else CallError("raised " + str(value).split(":", 1)[0], str(value))

    def _check_deadlines(self, results: list) -> None:
        now = time.monotonic()
        for worker in list(self._pool):
            if worker.index is not None and now - worker.since > self.timeout_s:
                results[worker.index] = CallError("timeout", f"timeout after {self.timeout_s:g}s "
                                                             "(reward.options.timeout_s)")
                self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        """Kill one worker (the only way to stop a call stuck in C code) and fork its successor."""
        worker.kill()
        self._pool[self._pool.index(worker)] = self._fork()
