"""Dr. GRPO: GRPO "done right" (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
Perspective", arXiv 2503.20783, §3.2)."""

from __future__ import annotations

from lit_rlvr.algorithms.common import check_fixed
from lit_rlvr.module import GRPOModule


class DrGRPOModule(GRPOModule):
    """GRPO without its two normalisation biases:

    * advantage A_i = r_i − mean_g r, no division by std_g r (which up-weights prompts that are too easy or too
      hard: `functional.grpo_advantages(scale_by_std=False)`);
    * loss per sequence = Σ_t s_i,t / L with the constant L = `max_new_tokens` (the generation budget), then the
      mean over sequences, instead of Σ_t s_i,t / |o_i| (which shrinks the gradient of long wrong answers:
      aggregation `seq-mean-token-sum-norm`). The entropy and KL terms use the same aggregation.

    These two choices define the method, so `scale_adv_by_std` and `loss_aggregation` are fixed (an override
    that contradicts them is an error); every other `GRPOModule` argument passes through.
    """

    def __init__(self, scale_adv_by_std: bool = False, loss_aggregation: str = "seq-mean-token-sum-norm", **kwargs):
        check_fixed("dr_grpo", scale_adv_by_std=(scale_adv_by_std, False),
                    loss_aggregation=(loss_aggregation, "seq-mean-token-sum-norm"))
        super().__init__(scale_adv_by_std=scale_adv_by_std, loss_aggregation=loss_aggregation, **kwargs)
