"""Held-out evaluation metrics: accuracy, unbiased pass@k and mean@k over n samples per prompt."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lit_rlvr.functional.passk import pass_at_k


class ValidationMetrics(nn.Module):
    """Accumulates a [B, n] correctness matrix per batch; reduces across ranks through torchmetrics.

    `val/accuracy` is the mean correctness of all samples (the greedy accuracy when n = 1), `val/mean@k`
    the same over the n samples (k = n), `val/pass@k` the unbiased pass@k of Chen et al. (2021) with k = n, and
    `val/pass@2`, `val/pass@4`, ... the same estimator at each power of two below n (a pass@k curve from one
    evaluation).
    """

    def __init__(self, num_samples: int):
        super().__init__()
        self.num_samples = num_samples
        self.accuracy = MeanMetric()
        self.pass_at_k = MeanMetric()
        self.ladder = [k for k in (2 ** i for i in range(1, 16)) if k < num_samples]
        self.pass_at = nn.ModuleDict({str(k): MeanMetric() for k in self.ladder})

    def update(self, correct: Tensor) -> None:
        correct = correct.float()  # [B, n]
        self.accuracy.update(correct.mean(-1))
        value, _ = pass_at_k(correct.sum(-1).long(), self.num_samples, self.num_samples)
        self.pass_at_k.update(value)
        for k in self.ladder:
            self.pass_at[str(k)].update(pass_at_k(correct.sum(-1).long(), self.num_samples, k)[0])

    def compute(self) -> dict[str, Tensor]:
        accuracy = self.accuracy.compute()
        ladder = {f"val/pass@{k}": self.pass_at[str(k)].compute() for k in self.ladder}
        return {"val/accuracy": accuracy, "val/mean@k": accuracy, "val/pass@k": self.pass_at_k.compute(), **ladder}

    def reset(self) -> None:
        # Lightning runs `trainer.validate` under inference mode but validation inside `fit` under no_grad: states
        # re-created under inference mode would be inference tensors that the next in-fit update cannot add to
        with torch.inference_mode(False):
            self.accuracy.reset()
            self.pass_at_k.reset()
            for metric in self.pass_at.values():
                metric.reset()
