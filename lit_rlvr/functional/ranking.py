"""Ranking metrics as pure tensor functions (used to score the V0.5 prior against this step's outcomes)."""

from __future__ import annotations

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
    """`binary_auroc` on numpy (Mann–Whitney with average ranks for ties); NaN when a
    class is empty."""
    scores = scores.astype(np.float64).ravel()
    labels = labels.astype(bool).ravel()
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)  # [U]
    end = np.cumsum(counts).astype(np.float64)  # [U]
    ranks = (end - (counts - 1) / 2)[inverse.ravel()]  # [N] average rank
    pos = float(labels.sum())
    neg = labels.size - pos
    u = ranks[labels].sum() - pos * (pos + 1) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(u) / np.float64(pos * neg))
