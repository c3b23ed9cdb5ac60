"""Pure tensor math of the papers: advantages, policy losses, KL estimators, aggregation, V0.5 fusion and OSLA;
and the model FLOPs of a step (flops.py) and each phase's roofline bound (roofline.py).
Functions take tensors plus keyword hyperparameters and return `(value, metrics)` where metrics are detached."""

from lit_rlvr.functional.advantages import (
    ADVANTAGES,
    GROUP_FILTER_METRICS,
    constant_groups,
    dr_grpo_advantages,
    group_mean,
    group_std,
    grpo_advantages,
    informative_groups,
)
from lit_rlvr.functional.chunks import chunk_groups, partial_chunk_success
from lit_rlvr.functional.flops import forward_flops, generation_flops, update_flops
from lit_rlvr.functional.kl import KL_ESTIMATORS, kl_penalty
from lit_rlvr.functional.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    SEQUENCE_METRICS,
    aggregate,
    entropy_from_logits,
    gspo_loss,
    ppo_clip_loss,
    sequence_importance_mask,
    sequence_rows,
    token_logprobs,
)
from lit_rlvr.functional.micro_batches import micro_batches
from lit_rlvr.functional.rollout_correction import mismatch_metrics, rejection_mask, truncated_is_weights
from lit_rlvr.functional.shaping import overlong_penalty
from lit_rlvr.functional.prompt_history import (
    beta_allocation,
    beta_mean_std,
    dbb_advantages,
    discounted_beta_update,
    group_outcomes,
    uniform_allocation,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "GROUP_FILTER_METRICS",
    "POLICY_LOSSES",
    "SEQUENCE_METRICS",
    "KL_ESTIMATORS",
    "aggregate",
    "beta_allocation",
    "beta_mean_std",
    "dbb_advantages",
    "discounted_beta_update",
    "group_outcomes",
    "uniform_allocation",
    "chunk_groups",
    "constant_groups",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "forward_flops",
    "generation_flops",
    "group_mean",
    "group_std",
    "grpo_advantages",
    "informative_groups",
    "gspo_loss",
    "kl_penalty",
    "micro_batches",
    "mismatch_metrics",
    "overlong_penalty",
    "partial_chunk_success",
    "ppo_clip_loss",
    "rejection_mask",
    "sequence_importance_mask",
    "sequence_rows",
    "token_logprobs",
    "truncated_is_weights",
    "update_flops",
]
