"""Unbiased pass@k and mean@k over n sampled completions per prompt (Chen et al. 2021, arXiv:2107.03374).

Per prompt with n samples of which c are correct:

    pass@k = 1 − C(n − c, k) / C(n, k) = 1 − ∏_{i = n−c+1}^{n} (1 − k / i)      (k ≤ n)

The product form avoids the huge binomials (C(1024, 512) overflows float64); it is 1 as soon as n − c < k
(the term i = k is 0) and 0 when c = 0 (empty product). mean@k is the plain accuracy c / n.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pass_at_k(num_correct: Tensor, num_samples: Tensor | int, k: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Unbiased pass@k per prompt.

    Args:
        num_correct: [B] long, c — correct samples per prompt.
        num_samples: [B] long or an int, n — samples per prompt (prompts may differ).
        k: samples the metric pretends to draw; 1 ≤ k. A prompt with n < k gets NaN (pass@k is undefined
            there; checked in-graph, without a device sync).

    Returns:
        value [B] float32, metrics {"pass@k": batch mean over prompts with n ≥ k}.
    """
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
    c = num_correct.long()  # [B]
    n = torch.as_tensor(num_samples, device=c.device).long().expand_as(c)  # [B]
    if isinstance(num_samples, Tensor):  # sizing the product needs max n: one host sync (none for an int n)
        n_max = int(n.max()) if n.numel() else 0
    else:
        n_max = int(num_samples)
    i = torch.arange(1, n_max + 1, device=c.device, dtype=torch.float64)  # [N]
    in_range = (i > (n - c).unsqueeze(-1)) & (i <= n.unsqueeze(-1))  # [B, N] the factors i = n−c+1 .. n
    factors = torch.where(in_range, 1.0 - k / i, torch.ones_like(i))  # [B, N]
    value = 1.0 - factors.prod(dim=-1)  # [B] float64
    value = torch.where(n >= k, value, torch.full_like(value, float("nan"))).float()  # [B]
    return value, {"pass@k": value.nanmean().detach()}


def mean_at_k(num_correct: Tensor, num_samples: Tensor | int) -> tuple[Tensor, dict[str, Tensor]]:
    """mean@k: the accuracy c / n over each prompt's n samples.

    Args:
        num_correct: [B] long, c. num_samples: [B] long or an int, n (≥ 1).

    Returns:
        value [B] float32, metrics {"mean@k": batch mean}.
    """
    c = num_correct.float()  # [B]
    n = torch.as_tensor(num_samples, device=c.device).float().expand_as(c)  # [B]
    value = c / n  # [B]
    return value, {"mean@k": value.mean().detach()}
