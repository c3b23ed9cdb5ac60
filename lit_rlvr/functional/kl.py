"""KL estimators between the policy and a frozen reference, per token (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html). With r = π_ref/π_θ evaluated on samples from π_θ:
k1 = −log r, k2 = ½ (log r)², k3 = (r − 1) − log r (unbiased and ≥ 0; verl's `low_var_kl`)."""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: Tensor, ref_logp: Tensor, *, estimator: str = "k3") -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate. logp, ref_logp: [N, T] -> [N, T]."""
    log_ratio = ref_logp - logp  # [N, T] log r
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)  # exp overflow guard; verl clamps the same way
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
