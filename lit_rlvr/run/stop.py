"""Stop requests (SIGTERM, a first Ctrl-C) that a step which does not end cannot defer forever.

`RunCheckpoint` records a request here and stops the run at the end of the step (saving it); generation, the
longest and the only unbounded part of a step (an environment that is never done, a huge budget, a slow engine),
calls `STOP.check()` between engine calls, turns and decoded tokens. Once a request is older than the grace period
(`stop_grace_s`), `check` raises `StopRequested`: the step is abandoned, nothing of it is saved (its half-made
state is never written), and the recipe exits naming the intact `last.ckpt`. Process-wide, as signal handlers are.
Armed only in a run of one process: ranks that abandon a step at different points would wait for each other in its
collectives; several ranks stop at the step's end, as before.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from lit_rlvr.config.errors import StopRequested


STOP_POLL_S = 0.2  # how often a wait that cannot be interrupted looks at the flag


class StopFlag:
    def __init__(self) -> None:
        self.since: Optional[float] = None  # monotonic time of the first request
        self.name = ""
        self.grace_s: Optional[float] = None  # None: not armed, requests wait for the step's end

    def arm(self, grace_s: Optional[float]) -> None:
        """A new run: no request yet; mid-step requests honoured after `grace_s` seconds (None: at the step's end)."""
        self.since, self.name, self.grace_s = None, "", grace_s

    def request(self, name: str) -> None:
        if self.since is None:
            self.since, self.name = time.monotonic(), name

    @property
    def requested(self) -> bool:
        return self.since is not None

    @property
    def expired(self) -> bool:
        """A request older than the grace period: the step under way is (being) abandoned."""
        return self.since is not None and self.grace_s is not None and time.monotonic() - self.since >= self.grace_s

    def check(self) -> None:
        """Raise `StopRequested` when a request has waited longer than the grace period."""
        if self.expired:
            waited = time.monotonic() - self.since
            raise StopRequested(self.name, f"{self.name} {waited:.0f}s ago, more than stop_grace_s={self.grace_s:g}: "
                                           "the step in progress is abandoned")


STOP = StopFlag()


@contextmanager
def stop_requests(grace_s: Optional[float]) -> Iterator[None]:
    """Outside a fit (the evaluation after training): SIGTERM and a first Ctrl-C are recorded and honoured `grace_s`
    after they arrive, wherever generation checks (`STOP.check()` raises `StopRequested`); the handlers before are
    restored on exit. A second Ctrl-C aborts at once. Only the main thread can install handlers: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame) -> None:
        STOP.request("SIGINT")
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: STOP.request("SIGTERM")),
                signal.SIGINT: signal.signal(signal.SIGINT, on_sigint)}
    STOP.arm(grace_s)
    try:
        yield
    finally:
        STOP.arm(None)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
