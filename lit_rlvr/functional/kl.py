"""KL estimators between the policy and a frozen reference, per token (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html). With r = π_ref/π_θ evaluated on samples from π_θ:
k1 = −log r, k2 = ½ (log r)², k3 = (r − 1) − log r (unbiased and ≥ 0; verl's `low_var_kl`).

As a loss term, only k2's gradient is the gradient of KL(π_θ ‖ π_ref) on samples from π_θ:
∇k2 = (log π_θ − log π_ref)·∇log π_θ, whose expectation is ∇KL; k1's gradient has expectation 0 and k3's is the
gradient of the reverse KL(π_ref ‖ π_θ). verl's "k3+" (straight-through) keeps k3's value and takes k2's gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")


def kl_penalty(logp: Tensor, ref_logp: Tensor, *, estimator: str = "k3", k3_cap: Optional[float] = None) -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate. logp, ref_logp: [N, T] -> [N, T].

    k3 clamps log r to [−20, 20] before exp (verl does the same). verl's `low_var_kl` then also caps k3 at 10;
    here that cap is the option `k3_cap` (None = no cap, the default; 10.0 = verl's). A capped token gives no
    gradient, as in verl. k1 and k2 are never capped.
    `k3+` (verl's straight-through form): the value of k3 (clamped and capped alike), the gradient of k2 — never
    cut by the clamp or the cap, as in verl.
    """
    if k3_cap is not None and (estimator not in ("k3", "k3+") or not k3_cap > 0):
        raise ValueError(f"k3_cap={k3_cap} needs estimator='k3' or 'k3+' (got {estimator!r}) and a cap > 0 "
                         f"(verl: 10.0)")
    log_ratio = ref_logp - logp  # [N, T] log r
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator not in ("k3", "k3+"):
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    clamped = log_ratio.clamp(-20.0, 20.0)  # [N, T] exp overflow guard
    k3 = torch.exp(clamped) - 1.0 - clamped  # [N, T]
    k3 = k3 if k3_cap is None else k3.clamp(max=k3_cap)
    if estimator == "k3":
        return k3
    k2 = 0.5 * log_ratio**2  # [N, T]
    return k2 - k2.detach() + k3.detach()  # value k3 (k2 − k2 = 0 exactly), gradient k2's
