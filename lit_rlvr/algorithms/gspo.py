"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lit_rlvr import functional as F
from lit_rlvr.algorithms.common import check_fixed
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts


class GSPOModule(GRPOModule):
    """Sequence-level importance ratio and clipping (Eq. 5–7):

        s_i = exp( (1/|o_i|) Σ_t (log π_θ(o_i,t) − log π_old(o_i,t)) )
        J   = mean_i min( s_i·A_i, clip(s_i, 1 − ε_low, 1 + ε_high)·A_i )

    with the group-normalised GRPO advantage A_i. The paper's clip range is tiny (ε_low = 3e-4,
    ε_high = 4e-4) because s_i is a length-normalised (geometric-mean) ratio. The objective is a mean over
    sequences, so `loss_aggregation` is fixed to `seq-mean-token-mean` (micro-batches are weighted by
    sequence count; entropy/KL terms use the same reduction).
    """

    # its clip fraction counts sequences, not tokens: micro-batches weight it by sequence count
    token_metrics = GRPOModule.token_metrics - {"loss/pg_clipfrac"}
    sequence_metrics = GRPOModule.sequence_metrics | {"loss/pg_clipfrac"}

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4, loss_aggregation: str = "seq-mean-token-mean",
                 dual_clip: Optional[float] = None, **kwargs):
        # dual-clip floors per-token terms; GSPO clips one ratio per sequence, so it has no such option
        check_fixed("gspo", loss_aggregation=(loss_aggregation, "seq-mean-token-mean"), dual_clip=(dual_clip, None))
        super().__init__(eps_low=eps_low, eps_high=eps_high, loss_aggregation=loss_aggregation, dual_clip=dual_clip,
                         **kwargs)

    def policy_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    rollouts: Rollouts) -> tuple[Tensor, dict[str, Tensor]]:
        """logp, old_logp, mask: [n, T]; advantages: [n]. Metrics: `loss/pg_clipfrac` = sequences clipped."""
        return F.gspo_loss(logp, old_logp, advantages, mask, eps_low=self.hparams.eps_low,
                           eps_high=self.hparams.eps_high)
