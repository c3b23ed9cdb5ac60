"""Policy-gradient surrogate losses and their aggregation over tokens (DESIGN §4).

Shapes: N completions, T response tokens; `mask` [N, T] True = the token counts.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(values: Tensor, mask: Tensor, mode: str, *, norm_len: Optional[int] = None) -> Tensor:
    """Reduce per-token values [N, T] to a scalar.

    * `token-mean`: mean over all counted tokens of the batch (DAPO, Yu et al. 2025, Eq. 12).
    * `seq-mean-token-mean`: mean over tokens of each sequence, then over sequences (GRPO paper, Eq. 3).
    * `seq-mean-token-sum`: token sum of each sequence, then mean over sequences (verl's mode of that name; a
      sequence weighs by its length, and the loss scale grows with the response length).
    * `seq-mean-token-sum-norm`: token sum of each sequence divided by the constant `norm_len` (the maximum
      response length), then mean over sequences (Dr. GRPO, Liu et al. 2025, Eq. 2).
    """
    mask = mask.to(values.dtype)  # [N, T]
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp_min(1.0)
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)  # [N]
        return per_seq.mean()
    if mode == "seq-mean-token-sum":
        return (values * mask).sum(-1).mean()
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_len (the max response length)")
        return ((values * mask).sum(-1) / norm_len).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    aggregation: str = "seq-mean-token-mean",
    norm_len: Optional[int] = None,
    dual_clip: Optional[float] = None,
    token_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017, Eq. 7; asymmetric clip from DAPO, Eq. 10).

    ratio = exp(logp − old); s = min(ratio·A, clip(ratio, 1−ε_low, 1+ε_high)·A); loss = −aggregate(s).
    Dual-clip (Ye et al. 2020, arXiv 1912.09729, Eq. 5; verl's `clip_ratio_c`, 3.0 there): with `dual_clip` = c > 1,
    a token with A < 0 takes s = max(s, c·A), so a ratio that ran past c stops pushing its probability down
    (its gradient is 0). None (the default) turns it off. TRL's GRPO `delta` (two-sided clipping, off by default)
    gives the same loss for c ≥ 1 + ε_high. `token_weights` w [N, T] (the rollout correction's truncated IS
    weights and rejection mask; None = 1) scale each token's term after clipping: s ← w·s, as verl weights its
    per-token policy losses; the normaliser of the aggregation is unchanged.

    Args: logp, old_logp, mask: [N, T]; advantages: [N] (one per completion, broadcast over its tokens).
    Returns: loss (scalar), metrics `loss/pg_clipfrac` (tokens where the clipped term is taken),
    `loss/approx_kl` (token-mean of k2 = ½(logp − old)²; verl's `ppo_kl` is k1, the mean of old − logp) and, with
    dual-clip, `loss/pg_clipfrac_lower` (tokens where c·A is taken).
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip={dual_clip}: the lower bound c of dual-clip PPO must be > 1 (verl: 3.0); "
                         f"None turns it off")
    log_ratio = logp - old_logp  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    adv = advantages[:, None].to(logp.dtype)  # [N, 1]
    unclipped = ratio * adv  # [N, T]
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv  # [N, T]
    surrogate = torch.minimum(unclipped, clipped)  # [N, T]
    m = mask.to(logp.dtype)
    count = m.sum().clamp_min(1.0)
    metrics = {
        "loss/pg_clipfrac": ((clipped < unclipped).to(logp.dtype) * m).sum().detach() / count,
        "loss/approx_kl": (0.5 * log_ratio.detach() ** 2 * m).sum() / count,
    }
    if dual_clip is not None:
        floor = dual_clip * adv  # [N, 1]
        lower = (adv < 0) & (floor > surrogate)  # [N, T]
        surrogate = torch.where(lower, floor, surrogate)  # [N, T]
        metrics["loss/pg_clipfrac_lower"] = (lower.to(logp.dtype) * m).sum().detach() / count
    if token_weights is not None:
        surrogate = surrogate * token_weights.detach().to(surrogate.dtype)  # [N, T]
    loss = -aggregate(surrogate, mask, aggregation, norm_len=norm_len)
    return loss, metrics


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", Eq. 5–7): sequence-level ratio
    s_i = exp(mean_t(logp − old)), clipped per sequence; loss = −mean_i min(s_i·A_i, clip(s_i)·A_i).

    The token-level form with a stop-gradient keeps the per-token gradient of Eq. 10:
    s_i,t = sg[s_i]·exp(logp_t − sg[logp_t]) equals s_i in value.
    Defaults are the paper's clip range (3e-4, 4e-4).
    """
    m = mask.to(logp.dtype)  # [N, T]
    lengths = m.sum(-1).clamp_min(1.0)  # [N]
    seq_log_ratio = ((logp - old_logp) * m).sum(-1) / lengths  # [N]
    seq_ratio = torch.exp(seq_log_ratio)  # [N]
    unclipped = seq_ratio * advantages  # [N]
    clipped = torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages  # [N]
    loss = -torch.minimum(unclipped, clipped).mean()
    metrics = {
        "loss/pg_clipfrac": (clipped < unclipped).to(logp.dtype).mean().detach(),
        "loss/approx_kl": (0.5 * ((logp - old_logp).detach() ** 2) * m).sum() / m.sum().clamp_min(1.0),
    }
    return loss, metrics


def sequence_importance_mask(
    logp: Tensor, old_logp: Tensor, mask: Tensor, *, tau: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Keep a sequence only when its importance ratio exp(Σ_t(logp − old)) lies in [1/τ, τ] (3PO, DESIGN §4).

    Returns keep [N] bool and `loss/seq_mask_frac` (fraction dropped).
    """
    seq_log_ratio = ((logp - old_logp).detach() * mask.to(logp.dtype)).sum(-1)  # [N]
    bound = torch.log(torch.tensor(tau, dtype=logp.dtype))
    keep = seq_log_ratio.abs() <= bound  # [N]
    return keep, {"loss/seq_mask_frac": 1.0 - keep.to(logp.dtype).mean()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position. logits [N, T, V] -> [N, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, T, V]
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log π(token) under softmax(logits / temperature). logits [N, T, V], tokens [N, T] -> [N, T] (fp32)."""
    logits = logits.float() / temperature  # [N, T, V]
    picked = torch.gather(logits, -1, tokens[..., None]).squeeze(-1)  # [N, T]
    return picked - torch.logsumexp(logits, dim=-1)
