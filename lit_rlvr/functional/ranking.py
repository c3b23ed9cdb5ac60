"""Ranking metrics as pure tensor functions (used to score the V0.5 prior against this step's outcomes)."""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import torch
from torch import Tensor


def binary_auroc(scores: Tensor, labels: Tensor) -> Tensor:
    """Area under the ROC curve of `scores` ([N] float) for `labels` ([N] bool), as a 0-dim tensor.

    Mann–Whitney form: AUC = (Σ ranks of positives − P(P+1)/2) / (P·Q) with P positives, Q negatives and tied
    scores given their average rank (a tie counts ½). NaN when either class is empty (no ranking to judge;
    torchmetrics returns 0 there, which would read as "perfectly wrong"). O(N log N), no host sync.
    """
    scores = scores.detach().double().flatten()  # [N] float64: rank sums stay exact for large N
    labels = labels.detach().bool().flatten()  # [N]
    if scores.shape != labels.shape:
        raise ValueError(f"binary_auroc: scores {tuple(scores.shape)} and labels {tuple(labels.shape)} differ")
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)  # [U]
    end = counts.cumsum(0).double()  # [U] 1-based rank of the last element of each tie block
    mean_rank = end - (counts.double() - 1) / 2  # [U] average rank inside the block
    ranks = mean_rank[inverse]  # [N]
    pos = labels.sum().double()  # []
    neg = labels.numel() - pos  # []
    u = ranks[labels].sum() - pos * (pos + 1) / 2  # [] Mann–Whitney U of the positives
    return (u / (pos * neg)).float()  # [] 0/0 = NaN when a class is empty


def binary_auroc_py(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """`binary_auroc` in plain Python on [N] values; NaN when a class is empty. The Mann–Whitney U counted
    directly: each positive scores the negatives below it plus ½ per tied negative, U = Σ (below +
    below_or_tied) / 2 — the rank-sum form's value exactly (sums of halves). O(N log N); V0.5 scores a few
    dozen rollouts per step, where a tensor or array op's overhead would be the whole cost."""
    negatives = sorted(s for s, positive in zip(scores, labels) if not positive)
    positives = [s for s, positive in zip(scores, labels) if positive]
    if not positives or not negatives:
        return math.nan
    twice_u = sum(bisect.bisect_left(negatives, s) + bisect.bisect_right(negatives, s) for s in positives)
    return twice_u / 2 / (len(positives) * len(negatives))
