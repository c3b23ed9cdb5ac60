"""Policy-gradient surrogate losses and their aggregation over tokens (docs/architecture.md §4).

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

    "Sequences" are the rows with at least one counted token (`sequence_rows`): a row whose mask is all False
    has no term, so it does not dilute the mean of the others (verl's `agg_loss` excludes such rows too).
    """
    mask = mask.to(values.dtype)  # [N, T]
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp_min(1.0)
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    if mode == "seq-mean-token-sum-norm" and norm_len is None:
        raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_len (the max response length)")
    lengths = mask.sum(-1)  # [N]
    num_seqs = sequence_rows(mask).sum().to(values.dtype).clamp_min(1.0)  # [] sequences, empty rows left out
    sums = (values * mask).sum(-1)  # [N]: 0 for an empty row
    if mode == "seq-mean-token-mean":
        return (sums / lengths.clamp_min(1.0)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return sums.sum() / num_seqs
    return (sums / norm_len).sum() / num_seqs  # seq-mean-token-sum-norm


def sequence_rows(mask: Tensor) -> Tensor:
    """[N] bool: the rows of `mask` ([N, T]) with at least one counted token — the sequences that sequence means
    (`aggregate`'s seq-mean modes, GSPO, the importance mask's drop fraction) average over."""
    return mask.bool().any(-1)


# verl clamps the token log-ratio to [−20, 20] before exp in its PPO losses: a finite loss and gradient when the
# behaviour log-prob is far off (e^20 ≈ 4.9e8; fp32 exp overflows past 88), and no gradient beyond the bound
LOG_RATIO_BOUND = 20.0
# and GSPO's sequence log-ratio (a mean over tokens) from above at 10 (verl's compute_policy_loss_gspo)
SEQ_LOG_RATIO_MAX = 10.0


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

    ratio = exp(clamp(logp − old, ±20)); s = min(ratio·A, clip(ratio, 1−ε_low, 1+ε_high)·A); loss = −aggregate(s).
    The clamp is verl's (`LOG_RATIO_BOUND`): inside ±20 it changes nothing; a token past it gives no gradient.
    Dual-clip (Ye et al. 2020, arXiv 1912.09729, Eq. 5; verl's `clip_ratio_c`, 3.0 there): with `dual_clip` = c > 1,
    a token with A < 0 takes s = max(s, c·A), so a ratio that ran past c stops pushing its probability down
    (its gradient is 0). None (the default) turns it off. TRL's GRPO `delta` (two-sided clipping, off by default)
    gives the same loss for c ≥ 1 + ε_high. `token_weights` w [N, T] (the rollout correction's truncated IS
    weights and rejection mask; None = 1) scale each token's term after clipping: s ← w·s, as verl weights its
    per-token policy losses; the normaliser of the aggregation is unchanged.

    Args: logp, old_logp, mask: [N, T]; advantages: [N] (one per completion, broadcast over its tokens).
    Returns: loss (scalar), metrics `loss/pg_clipfrac` (tokens where the clipped term is taken),
    `loss/approx_kl` (token-mean of k2 = ½(logp − old)² of the clamped log-ratio; verl's `ppo_kl` is k1, the mean
    of old − logp) and, with
    dual-clip, `loss/pg_clipfrac_lower` (tokens where c·A is taken).
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip={dual_clip}: the lower bound c of dual-clip PPO must be > 1 (verl: 3.0); "
                         f"None turns it off")
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [N, T]
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
    aggregation: str = "seq-mean-token-mean",
    norm_len: Optional[int] = None,
    dual_clip: Optional[float] = None,
    token_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", Eq. 5–7): sequence-level ratio
    s_i = exp(min(mean_t(logp − old), 10)), clipped per sequence; loss = −mean_i min(s_i·A_i, clip(s_i)·A_i).

    Token weights and other aggregations use the token-level form of Eq. 10, as verl's GSPO loss does:
    s_i,t = sg[s_i]·exp(logp_t − sg[logp_t]) equals s_i in value and gives token t the gradient of Eq. 10;
    each token's term min(s_i,t·A_i, clip(s_i,t)·A_i) is scaled by its weight w_t [N, T] (the rollout
    correction's IS weights and rejection mask) and the terms are reduced by `aggregation` (with
    `seq-mean-token-mean` and w = 1 this is the sequence-level loss above, which is computed directly then).
    So a weight acts on its own token's gradient, and a sequence's loss value is its clipped term times the
    mean weight of its tokens (docs/fidelity.md). `dual_clip` must be None: it floors per-token PPO terms and has
    no sequence-level form here. Defaults are the paper's clip range (3e-4, 4e-4). The cap of the log-ratio at
    10 is verl's (`SEQ_LOG_RATIO_MAX`; no gradient past it). Sequence means are over `sequence_rows`.
    Metrics: `loss/pg_clipfrac` = sequences clipped (a mean over sequences: `SEQUENCE_METRICS`), `loss/approx_kl`.
    """
    if dual_clip is not None:
        raise ValueError(f"dual_clip={dual_clip}: GSPO clips one ratio per sequence; dual-clip floors per-token "
                         "PPO terms (policy loss ppo_clip); None turns it off")
    m = mask.to(logp.dtype)  # [N, T]
    present = sequence_rows(mask)  # [N]
    num_seqs = present.sum().to(logp.dtype).clamp_min(1.0)  # []
    lengths = m.sum(-1).clamp_min(1.0)  # [N]
    mean_log_ratio = ((logp - old_logp) * m).sum(-1) / lengths  # [N]
    seq_ratio = torch.exp(mean_log_ratio.clamp(max=SEQ_LOG_RATIO_MAX))  # [N]
    unclipped = seq_ratio * advantages  # [N]
    clipped = torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages  # [N]
    metrics = {
        "loss/pg_clipfrac": ((clipped < unclipped) & present).sum().to(logp.dtype).detach() / num_seqs,
        "loss/approx_kl": (0.5 * ((logp - old_logp).detach() ** 2) * m).sum() / m.sum().clamp_min(1.0),
    }
    if token_weights is None and aggregation == "seq-mean-token-mean":
        loss = -(torch.minimum(unclipped, clipped) * present).sum() / num_seqs
        return loss, metrics
    token_log_ratio = logp - logp.detach() + mean_log_ratio.detach()[:, None]  # [N, T]: log s_i in value
    token_ratio = torch.exp(token_log_ratio.clamp(max=SEQ_LOG_RATIO_MAX))  # [N, T]
    adv = advantages[:, None].to(logp.dtype)  # [N, 1]
    terms = torch.minimum(token_ratio * adv, torch.clamp(token_ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)  # [N, T]
    if token_weights is not None:
        terms = terms * token_weights.detach().to(terms.dtype)  # [N, T]
    return -aggregate(terms, mask, aggregation, norm_len=norm_len), metrics


# the policy losses `algorithm.policy_loss` chooses from; one signature: (logp, old_logp, advantages, mask, *,
# eps_low, eps_high, aggregation, norm_len, dual_clip, token_weights) -> (loss, metrics)
POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss}
# each loss's metrics that are means over sequences (micro-batches weight them by sequences); the rest: over tokens
SEQUENCE_METRICS = {"ppo_clip": frozenset(), "gspo": frozenset({"loss/pg_clipfrac"})}


def sequence_importance_mask(
    logp: Tensor, old_logp: Tensor, mask: Tensor, *, tau: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Keep a sequence only when its importance ratio exp(Σ_t(logp − old)) lies in [1/τ, τ] (3PO;
    docs/architecture.md §4).

    Returns keep [N] bool and `loss/seq_mask_frac` (fraction of the `sequence_rows` dropped; an empty row has
    ratio 1 and is kept).
    """
    seq_log_ratio = ((logp - old_logp).detach() * mask.to(logp.dtype)).sum(-1)  # [N]
    bound = torch.log(torch.tensor(tau, dtype=logp.dtype))
    keep = seq_log_ratio.abs() <= bound  # [N]
    present = sequence_rows(mask)  # [N]
    count = present.sum().to(logp.dtype)  # []
    kept = (keep & present).sum().to(logp.dtype) / count.clamp_min(1.0)  # [] (as 1 − frac: keep.mean()'s bits)
    return keep, {"loss/seq_mask_frac": torch.where(count > 0, 1.0 - kept, 0.0)}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position. logits [N, T, V] -> [N, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, T, V]
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log π(token) under softmax(logits / temperature). logits [N, T, V], tokens [N, T] -> [N, T] (fp32)."""
    logits = logits.float() / temperature  # [N, T, V]
    picked = torch.gather(logits, -1, tokens[..., None]).squeeze(-1)  # [N, T]
    return picked - torch.logsumexp(logits, dim=-1)
