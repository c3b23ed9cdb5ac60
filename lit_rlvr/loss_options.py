"""Range and consistency checks of the module's loss and batching options (GRPOModule's constructor runs them,
so the Lightning CLI and plain Python get them too; the Hydra recipe's config checks come earlier)."""

from __future__ import annotations

from typing import Any

from lit_rlvr import functional as F


def check_loss_options(hp: Any) -> None:
    """Raise ValueError naming the first `algorithm.<key>` out of range; `hp` is the module's hyperparameters."""
    if hp.loss_aggregation not in F.AGGREGATIONS:
        raise ValueError(f"algorithm.loss_aggregation={hp.loss_aggregation!r}; valid: {', '.join(F.AGGREGATIONS)}")
    if hp.kl_estimator not in F.KL_ESTIMATORS:
        raise ValueError(f"algorithm.kl_estimator={hp.kl_estimator!r}; valid: {', '.join(F.KL_ESTIMATORS)}")
    for key in ("group_size", "ppo_epochs", "mini_batches", "micro_batch_size", "max_new_tokens", "eval_samples"):
        if getattr(hp, key) < 1:
            raise ValueError(f"algorithm.{key} must be >= 1, got {getattr(hp, key)}")
    if hp.micro_batch_tokens is not None and hp.micro_batch_tokens < 1:
        raise ValueError(f"algorithm.micro_batch_tokens must be >= 1 or null (off), got {hp.micro_batch_tokens}")
    if not (0 <= hp.eps_low < 1 and hp.eps_high >= 0):
        raise ValueError(f"algorithm.eps_low must be in [0, 1) and eps_high >= 0, got {hp.eps_low}, {hp.eps_high}")
    if hp.dual_clip is not None and not hp.dual_clip > 1:
        raise ValueError(f"algorithm.dual_clip={hp.dual_clip}: the dual-clip bound c must be > 1 (verl: 3.0); "
                         "null turns it off")
    if hp.seq_mask_tau is not None and not hp.seq_mask_tau > 1:
        raise ValueError(f"algorithm.seq_mask_tau={hp.seq_mask_tau}: the importance mask keeps ratios in "
                         "[1/τ, τ], so τ must be > 1 (3PO's paper: 2); null turns the mask off")
    if hp.kl_k3_cap is not None and (hp.kl_estimator not in ("k3", "k3+") or not hp.kl_k3_cap > 0):
        raise ValueError(f"algorithm.kl_k3_cap={hp.kl_k3_cap} caps the k3 estimator: it needs algorithm."
                         f"kl_estimator=k3 or k3+ (got {hp.kl_estimator}) and a cap > 0 (verl: 10); null = no cap")
