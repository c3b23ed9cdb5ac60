"""The run's counters: what it generated and how its steps went; saved in its checkpoints, summed over ranks."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lit_rlvr.run import distributed as D

SUMMED = ("rollouts_total", "tokens_generated", "reward_failures")  # per rank; the run's is the sum over ranks


class RunCounters(dict):
    """A dict of the run's counters (`rollouts_total`, `tokens_generated`, `skipped_steps`, `bad_steps_in_row`,
    `reward_failures`, `rl_steps`); the rollout driver's results and the update add to it. `rl_steps` is the policy's
    version, which only the rollout source's push advances (`lit_rlvr.rollout.source`)."""

    def __init__(self) -> None:
        super().__init__(rollouts_total=0, tokens_generated=0, skipped_steps=0, bad_steps_in_row=0,
                         reward_failures=0, rl_steps=0)

    def global_values(self) -> dict[str, int]:
        """The counters summed over data-parallel ranks (a collective: call it on every rank)."""
        values = D.all_reduce(torch.tensor([self[k] for k in SUMMED], dtype=torch.long))
        return {**self, **dict(zip(SUMMED, values.tolist()))}

    def restore(self, saved: Mapping[str, Any], rank: int) -> None:
        """A checkpoint's counters (the run's totals): rank 0 continues them, the other ranks count from 0."""
        self.update(saved)
        if rank != 0:
            self.update(dict.fromkeys(SUMMED, 0))
