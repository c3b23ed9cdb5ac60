"""What one RL step records: its row of metrics (`step_row`, with the phase timings of `run.step_timer.StepTimer`)
and where the row goes (`write_step_metrics`: Lightning's loggers)."""

from __future__ import annotations

from typing import Any, Mapping

import lightning.pytorch as pl
import torch
from torch import Tensor

from lit_rlvr.run.step_timer import StepTimer


def step_row(rollouts: Any, counters: Mapping[str, int], rollouts_at_start: int, timer: StepTimer, step_s: float,
             extra: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The step's own metrics: reward and response figures of the trained `rollouts` (a `Rollouts`), the run's
    `counters` (rollouts generated since `rollouts_at_start`, the step's first), the `timer`'s phases, then `extra`
    (the FLOPs and the environment's figures)."""
    lengths = rollouts.response_mask.sum(-1).float()  # [N]
    return {
        "reward/mean": rollouts.rewards.mean(),
        "reward/accuracy": (rollouts.rewards > 0).float().mean(),
        "reward/malformed_frac": rollouts.malformed.float().mean(),
        "response/len_mean": lengths.mean(),
        "response/len_max": lengths.max(),
        "response/clip_frac": torch.tensor([r == "length" for r in rollouts.finish_reason]).float().mean(),
        # generated this step (more than the trained batch when groups were dropped)
        "rollouts/per_step": torch.tensor(float(counters["rollouts_total"] - rollouts_at_start)),
        "rollouts/total": torch.tensor(float(counters["rollouts_total"])),
        "train/skipped_steps": torch.tensor(float(counters["skipped_steps"])),
        "perf/tokens_per_s": torch.tensor(rollouts.num_tokens() / max(step_s, 1e-9)),
        "time/step_s": torch.tensor(step_s),
        **{f"time/{k}": torch.tensor(v) for k, v in timer.times.items()},
        **extra,
    }


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
