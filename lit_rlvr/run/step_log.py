"""What one RL step records: its phase timings (`StepTimer`) and its row of metrics (`write_step_metrics`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import lightning.pytorch as pl
from torch import Tensor

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


def write_step_metrics(trainer: pl.Trainer, metrics: dict[str, Tensor], progress_bar: tuple[str, ...] = ()) -> None:
    """One row per step to every logger, the values to `trainer.callback_metrics` (for monitors) and the
    `progress_bar` keys to the progress bar.

    Not through `LightningModule.log`: Lightning's per-key bookkeeping costs ~1-2 ms per metric and call, about a
    third of a tiny-model step with ~25 metrics (measured with cProfile on the reference workload). This is what
    its logger connector does with on-step metrics, in one call."""
    connector = trainer._logger_connector
    connector._callback_metrics.update(metrics)
    connector._progress_bar_metrics.update({k: float(metrics[k]) for k in progress_bar})
    if connector.should_update_logs or trainer.should_stop:
        connector.log_metrics(dict(metrics))
