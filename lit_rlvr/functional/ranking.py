"""Ranking metrics as pure tensor functions (used to score the V0.5 prior against this step's outcomes)."""

from __future__ import annotations

import math

import numpy as np
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


def binary_auroc_np(scores: np.ndarray, labels: np.ndarray) -> float:
    """`binary_auroc` on numpy; NaN when a class is empty. The Mann–Whitney U counted directly: each positive
    scores the negatives below it plus ½ per tied negative, U = Σ (below + below_or_tied) / 2 — the rank-sum
    form's value exactly (sums of halves), in a few array ops instead of a unique/rank pass (this is a
    per-step metric of V0.5, where the ops' overhead is the cost). O(N log N)."""
    scores = scores.astype(np.float64).ravel()
    labels = labels.astype(bool).ravel()
    pos, neg = scores[labels], np.sort(scores[~labels])  # [P], [Q]
    if pos.size == 0 or neg.size == 0:
        return math.nan
    below = np.searchsorted(neg, pos, "left").sum() + np.searchsorted(neg, pos, "right").sum()  # 2·U
    return float(below / 2) / float(pos.size * neg.size)
