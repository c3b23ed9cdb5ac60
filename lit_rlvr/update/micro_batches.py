"""The one micro-batch planner of the update: π_old's recompute and the backward passes split a batch alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

from lit_rlvr import functional as F
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.run import distributed as D


@dataclass
class MicroBatchPlan:
    """The micro-batches of one batch: `micros` index tensors ([m] long, `functional.micro_batches`), `padding`
    stand-in micro-batches (FSDP gathers weights in every forward, so every rank runs as many: a rank with fewer
    runs zero-weight ones on sample 0), `trim`: each micro-batch cut to its longest row (the token budget; the
    fixed split runs every micro-batch at the batch's width). `metrics`: `micro/count`, `micro/padding_frac`."""

    micros: list[Tensor]
    padding: int
    trim: bool
    metrics: dict[str, Tensor]

    def parts(self, rollouts: Rollouts) -> Iterator[tuple[Tensor, Rollouts, bool]]:
        """(row index [m], the micro-batch as the forward takes it, real) per micro-batch, stand-ins last."""
        for i, micro in enumerate(self.micros + [torch.zeros(1, dtype=torch.long)] * self.padding):
            part = rollouts.select(micro)
            yield micro, part.trim_padding() if self.trim else part, i < len(self.micros)


def plan_micro_batches(rollouts: Rollouts, *, micro_batch_size: int,
                       micro_batch_tokens: Optional[int]) -> MicroBatchPlan:
    """`micro_batch_size` rows at a time, or with `micro_batch_tokens` rows of similar length up to that many padded
    tokens, prompt included (a collective under FSDP: call it on every rank)."""
    lengths = rollouts.prompt_mask.sum(-1) + rollouts.response_attention_mask.sum(-1)  # [N] forward widths
    width = None if micro_batch_tokens else rollouts.prompt_ids.shape[1] + rollouts.response_ids.shape[1]
    micros, metrics = F.micro_batches(lengths, max_rows=micro_batch_size, max_tokens=micro_batch_tokens,
                                      width=width)  # untrimmed fixed micro-batches run at the full width
    return MicroBatchPlan(micros, D.global_max(len(micros)) - len(micros), bool(micro_batch_tokens), metrics)
