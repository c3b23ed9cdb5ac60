"""`AsyncRewardRunner`: an `async def` reward (or an object whose `__call__` is one), awaited concurrently.

The calls of a batch run on one event loop in a thread of the training process, at most
`reward.options.max_concurrent` at a time (an `asyncio.Semaphore`: the cap that keeps an external API within its
rate). Each call is bounded by `reward.options.timeout_s` (`asyncio.wait_for`, which cancels it) and follows the
same rule as a sync call: what it raises, a timeout and a return that breaks the contract make that completion
malformed, scored `failure_score` and counted. A coroutine that blocks the loop in sync code (time.sleep, a busy
loop) cannot be cancelled: when the batch overruns its whole budget the loop is abandoned and `stop_reason` set,
like a sync call that cannot be cut (the module saves and stops).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
from concurrent import futures
from typing import Any, Optional

from lit_rlvr.rewards.base import CallError, RewardFn, Runner, copied, plain_result, wait_or_stop
from lit_rlvr.rewards.options import RunnerOptions

log = logging.getLogger(__name__)

_GRACE_S = 2.0  # beyond the batch's budget before the loop counts as blocked


def is_async(fn: Any) -> bool:
    """Whether calling `fn` returns a coroutine to await (an `async def`, or an object with an async `__call__`)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class AsyncRewardRunner(Runner):
    """See the module docstring; `close()` stops the loop's thread."""

    def __init__(self, fn: RewardFn, options: Optional[RunnerOptions] = None, **settings: Any):
        super().__init__(fn, options, **settings)
        self.max_concurrent = self.options.cap
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def _score(self, jobs: list[tuple]) -> list[Any]:
        loop = self._running_loop()
        future = asyncio.run_coroutine_threadsafe(self._score_all(jobs), loop)
        budget = self.timeout_s * math.ceil(len(jobs) / self.max_concurrent) + _GRACE_S
        try:
            if wait_or_stop(lambda s: bool(futures.wait([future], s).done), budget) and future.exception() is None:
                return future.result()
        except BaseException:  # StopRequested: the loop's calls are abandoned with it
            self._abandon(loop, future)
            raise
        why = type(future.exception()).__name__ if future.done() else "TimeoutError"
        self._abandon(loop, future)  # blocked in sync code (or broken): never reused
        self.stop_reason = (f"the async reward's calls ran past reward.options.timeout_s={self.timeout_s:g} and "
                            "could not be cancelled (a coroutine blocks the event loop in sync code: await "
                            "asyncio.sleep, not time.sleep; or use a sync reward with isolation=process)")
        return [CallError("loop blocked", f"timeout, the event loop was blocked ({why})")] * len(jobs)

    def _abandon(self, loop: asyncio.AbstractEventLoop, future: Any) -> None:
        future.cancel()
        self._loop = None  # a daemon thread: never joined, never reused
        loop.call_soon_threadsafe(loop.stop)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="reward-async", daemon=True).start()
            self._loop = loop
        return self._loop

    async def _score_all(self, jobs: list[tuple]) -> list[Any]:
        gate = asyncio.Semaphore(self.max_concurrent)
        return list(await asyncio.gather(*(self._one(gate, args) for args in jobs)))

    async def _one(self, gate: asyncio.Semaphore, args: tuple) -> Any:
        async with gate:  # the time bound starts when the call does, not while it waits for a slot
            try:
                args = copied(args)
            except Exception as err:
                return CallError("arguments not copied", f"its arguments cannot be copied ({type(err).__name__}: "
                                                         f"{err})")
            try:
                value = await asyncio.wait_for(self._call(args), self.timeout_s)
                return plain_result(value)
            except asyncio.TimeoutError:
                return CallError("timeout", f"timeout after {self.timeout_s:g}s (reward.options.timeout_s)")
            except BaseException as err:  # SystemExit and the rest: the reward's failure, not the run's
                return CallError(f"raised {type(err).__name__}", f"{type(err).__name__}: {str(err)[:500]}")

    async def _call(self, args: tuple) -> Any:
        result = self.fn(*args)
        if inspect.isawaitable(result):
            result = await result
        return result

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
