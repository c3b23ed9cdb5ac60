"""KL estimators between the policy and a frozen reference, per token (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html). With r = π_ref/π_θ evaluated on samples from π_θ:
k1 = −log r, k2 = ½ (log r)², k3 = (r − 1) − log r (unbiased and ≥ 0; verl's `low_var_kl`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: Tensor, ref_logp: Tensor, *, estimator: str = "k3", k3_cap: Optional[float] = None) -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate. logp, ref_logp: [N, T] -> [N, T].

    k3 clamps log r to [−20, 20] before exp (verl does the same). verl's `low_var_kl` then also caps k3 at 10;
    here that cap is the option `k3_cap` (None = no cap, the default; 10.0 = verl's). A capped token gives no
    gradient, as in verl. k1 and k2 are never capped.
    """
    if k3_cap is not None and (estimator != "k3" or not k3_cap > 0):
        raise ValueError(f"k3_cap={k3_cap} needs estimator='k3' (got {estimator!r}) and a cap > 0 (verl: 10.0)")
    log_ratio = ref_logp - logp  # [N, T] log r
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)  # exp overflow guard
        k3 = torch.exp(log_ratio) - 1.0 - log_ratio
        return k3 if k3_cap is None else k3.clamp(max=k3_cap)
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
