"""Tensor forms of the V0.5 math that `lit_rlvr.functional.value_prior` computes in plain Python: the oracles
the tests check the library's functions against, bit for bit (and the forms whose properties they test)."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_rlvr.functional.value_prior import _squared_bias

def shrinkage_fusion(
    sample_mean: Tensor, prior: Tensor, counts: Tensor, *, noise_var: float = 1.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Fuse the prior V with the sample mean v̄_k of k rollouts (V0.5, Eq. 8, empirical shrinkage).

        Δ̂² = max(0, (v̄_k − V)² − σ²/k)      estimated squared bias of the prior
        w  = Δ̂² / (Δ̂² + σ²/k)               weight on the data, in [0, 1)
        b  = w·v̄_k + (1 − w)·V               fused baseline

    Guarantees: b = V exactly when (v̄_k − V)² ≤ σ²/k (the data cannot reject the prior), and
    |b − v̄_k| ≤ σ/√k always (the bias the prior can add is bounded by one standard error).

    Args:
        sample_mean: [B] float, v̄_k (reward scale); ignored where counts == 0.
        prior: [B] float, V on the reward scale; NaN = no prior for this prompt (b = v̄_k).
        counts: [B] int, k ≥ 0 rollouts behind each sample mean; k = 0 gives b = V.
        noise_var: σ², see `reward_noise_var`.

    Returns:
        baseline [B], metrics {"w" [B], "bias_sq" [B] (Δ̂²), "prior_rejected" [B] bool (Δ̂² > 0),
        "prior_missing" [B] bool}.
    """
    has_prior = torch.isfinite(prior)  # [B]
    has_data = counts > 0  # [B]
    k = counts.to(sample_mean.dtype).clamp_min(1)  # [B]
    noise = noise_var / k  # [B] σ²/k, variance of the sample mean
    bias_sq = _squared_bias(sample_mean, prior, counts, noise_var)  # [B]
    w = torch.where(torch.isinf(bias_sq), torch.ones_like(noise), bias_sq / (bias_sq + noise))  # [B]
    w = torch.where(has_data, w, torch.zeros_like(w))  # [B] no data: trust the prior
    # V + w·(v̄ - V) is the same convex combination, and equals V bit-for-bit when w == 0
    fused = prior + w * (sample_mean - prior)  # [B]
    fused = torch.where(has_data, fused, prior)  # [B] avoid 0·NaN when the sample mean is undefined
    baseline = torch.where(has_prior, fused, sample_mean)  # [B]
    metrics = {
        "w": w.detach(),
        "bias_sq": torch.where(has_data, bias_sq, torch.zeros_like(bias_sq)).detach(),
        "prior_rejected": (has_data & has_prior & (bias_sq > 0)).detach(),
        "prior_missing": (~has_prior).detach(),
    }
    return baseline, metrics


def expected_mse_reduction(
    sample_mean: Tensor, prior: Tensor, counts: Tensor, *, noise_var: float = 1.0
) -> Tensor:
    """MSE(k) − MSE(k+1) with Δ̂² held at its current estimate (V0.5, Eq. 12, inferred form), [B].

    Equals σ²/(k + r) − σ²/(k + 1 + r) with r = σ²/Δ̂²; at most σ²/(k(k+1)) (missing or far-off prior),
    0 when the prior is not rejected, +inf for k = 0 (no data yet: always worth a first sample).
    """
    k = counts.to(sample_mean.dtype)  # [B]
    bias_sq = _squared_bias(sample_mean, prior, counts, noise_var)  # [B]
    ratio = noise_var / bias_sq  # [B]
    gain = noise_var / (k + ratio) - noise_var / (k + 1 + ratio)  # [B]
    # k = 0 with r = 0 is inf - σ² = inf already; k = 0 with r = inf would be 0, but there is no data yet
    return torch.where(counts > 0, gain, torch.full_like(gain, float("inf")))  # [B]


def osla_wants_more(
    sample_mean: Tensor,
    prior: Tensor,
    counts: Tensor,
    *,
    noise_var: float = 1.0,
    cost: float = 0.0039,
    k_max: int = 16,
) -> Tensor:
    """One-step look-ahead stopping rule (V0.5, Eq. 12, inferred form): [B] bool, True = ask for sample k+1.

    Sample k+1 is worth its cost c iff MSE(k) − MSE(k+1) > c, and never past k_max. With c = 0.0039 ≈ 1/256
    and a far-off prior the gain is ≈ 1/(k(k+1)), which stays above c up to k = 15: 16 is the natural cap.
    Δ̂² is re-estimated from the current sample mean every time this is called (once per round).
    """
    gain = expected_mse_reduction(sample_mean, prior, counts, noise_var=noise_var)  # [B]
    return (gain > cost) & (counts < k_max)  # [B]


def allocate_round(
    wants_more: Tensor,
    gain: Tensor,
    counts: Tensor,
    *,
    k_max: int,
    min_active_frac: float = 0.25,
    pad_to: int = 32,
    round_size: int = 1,
) -> Tensor:
    """Extra samples per prompt for the next round of rollouts (V0.5 batch rules), [B] long.

    Rules from the paper: keep generating only while at least `min_active_frac` of the batch's prompts
    still ask for samples, and pad each round's request to a multiple of `pad_to` sequences.
    *(inferred)*: an active prompt gets `round_size` more samples (capped at k_max); the padding goes one
    sample at a time to the prompts with the largest expected MSE reduction `gain` (a prompt that has
    room gets at most one padding sample per pass, passes repeat until the padding is placed); a prompt
    never goes past k_max, so if the padding cannot all be placed, what fits is placed and the total is
    then not a multiple of `pad_to`.

    Args:
        wants_more: [B] bool, from `osla_wants_more`.
        gain: [B] float, from `expected_mse_reduction` (NaN counts as lowest).
        counts: [B] long, samples each prompt has so far.
    """
    if round_size < 1 or pad_to < 1 or not 0.0 <= min_active_frac <= 1.0:
        raise ValueError(
            f"allocate_round needs round_size ≥ 1, pad_to ≥ 1 and 0 ≤ min_active_frac ≤ 1; got "
            f"round_size={round_size}, pad_to={pad_to}, min_active_frac={min_active_frac}"
        )
    room = (k_max - counts).clamp_min(0).long()  # [B] samples each prompt may still take
    active = wants_more & (room > 0)  # [B]
    enough = active.sum() >= min_active_frac * counts.numel()  # [] bool tensor, no host sync
    enough = enough & active.any()  # [] an empty round is never "enough"
    extra = torch.where(active, room.clamp_max(round_size), torch.zeros_like(room))  # [B]
    total = extra.sum()  # []
    padding = (-total) % pad_to  # [] sequences to add so the round is a multiple of pad_to
    extra = extra + _place_padding(padding, gain, room - extra, k_max)  # [B]
    return torch.where(enough, extra, torch.zeros_like(extra))  # [B]


def _place_padding(padding: Tensor, gain: Tensor, room: Tensor, k_max: int) -> Tensor:
    """Give `padding` samples to the prompts of largest gain, one per prompt per pass, within `room`. [B]

    Pass p (1-based) offers one slot to every prompt with room ≥ p, best gain first; the first `padding`
    slots in (pass, rank) order are taken. Written as one [k_max, B] table instead of a loop over passes
    (a prompt can take at most k_max samples, so k_max passes suffice): a few ops, not ~6 per pass."""
    score = torch.nan_to_num(gain.float(), nan=float("-inf"))  # [B]
    order = torch.sort(score, descending=True, stable=True).indices  # [B] best first, ties by index
    passes = torch.arange(1, max(k_max, 0) + 1, device=room.device)  # [P]
    slots = room[order].unsqueeze(0) >= passes.unsqueeze(1)  # [P, B] pass p offers prompt b a slot
    taken = slots & (torch.cumsum(slots.flatten().long(), 0).view_as(slots) <= padding)  # [P, B] first slots
    out = torch.zeros_like(room)  # [B]
    out[order] = taken.long().sum(0)  # back to prompt order
    return out
