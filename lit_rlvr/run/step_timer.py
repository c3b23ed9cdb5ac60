"""`StepTimer`: the seconds one RL step spends per phase (`time/gen_s`, …). Apart from the step's metrics row
(`run.step_log`, which writes to Lightning's loggers) so that the rollout and the update time their phases
without loading Lightning."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("gen_s", "reward_s", "train_s", "sync_s")


class StepTimer:
    """Seconds spent per phase of the current step (`time/gen_s`, …): `with timer("gen_s"): ...` adds to it."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.start = time.perf_counter()

    def reset(self, phases: tuple[str, ...] = PHASES) -> None:
        self.times = dict.fromkeys(phases, 0.0)
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        """Add seconds measured elsewhere (e.g. by the rollout driver) to a phase."""
        self.times[phase] = self.times.get(phase, 0.0) + seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
