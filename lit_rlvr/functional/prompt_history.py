"""A prompt's reward history as a Beta posterior: DBB's baseline, boundary gating, and Beta-posterior allocation.

DBB, "Discounted Beta–Bernoulli Reward Estimation for Sample-Efficient RLVR" (Kim et al. 2026, arXiv 2603.18444):
each prompt's success probability p is estimated from its own rewards across the steps it was drawn in, old steps
discounted, and that estimate replaces the group's sample mean (and std) in the advantage. The paper's full text was
not readable where this was written; the update and the advantage below are our reading of its abstract (a
Beta–Bernoulli posterior over the prompt's history, discounted for the policy's drift, biased but of low and never
collapsing variance), and the defaults (γ = 0.9, a uniform Beta(1, 1) prior) are ours (docs/algorithms.md).

Rewards are binary on [low, high] (±1 by default): a completion succeeds when its reward is above the middle.
Shapes: B prompts (one group each), N completions. The per-prompt state is (α, β) [B] each.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor


def discounted_beta_update(alpha: Tensor, beta: Tensor, successes: Tensor, failures: Tensor, *, discount: float,
                           prior_alpha: float, prior_beta: float) -> tuple[Tensor, Tensor]:
    """One step of the discounted Beta–Bernoulli posterior of each prompt's success probability, [B] each:

        α_t = α₀ + γ·(α_{t−1} − α₀) + s_t        β_t = β₀ + γ·(β_{t−1} − β₀) + f_t

    s_t, f_t: this step's successes and failures of the prompt; γ ∈ (0, 1] the discount of older evidence (γ = 1:
    the plain Beta–Bernoulli posterior); α₀, β₀ > 0 the prior, which is never discounted, so the posterior's
    variance never collapses to 0. A prompt not seen before starts at (α₀, β₀) (pass those).
    """
    alpha = prior_alpha + discount * (alpha - prior_alpha) + successes  # [B]
    beta = prior_beta + discount * (beta - prior_beta) + failures  # [B]
    return alpha, beta


def beta_mean_std(alpha: Tensor, beta: Tensor, *, low: float = -1.0, high: float = 1.0) -> tuple[Tensor, Tensor]:
    """Mean and std of the reward predicted by Beta(α, β) over p, on the reward scale [low, high], [B] each:

        p̂ = α / (α + β)        μ = low + (high − low)·p̂        σ = (high − low)·√(p̂·(1 − p̂))

    σ is the std of one binary reward whose success probability is p̂ (the posterior predictive). It is > 0 for
    any α, β > 0.
    """
    p_hat = alpha / (alpha + beta)  # [B]
    span = high - low
    return low + span * p_hat, span * (p_hat * (1 - p_hat)).sqrt()


def group_outcomes(rewards: Tensor, group: Tensor, num_groups: int, *, low: float = -1.0,
                   high: float = 1.0) -> tuple[Tensor, Tensor]:
    """Successes (reward above the middle of [low, high]) and failures of each prompt, [B] float each."""
    success = (rewards > (low + high) / 2).to(rewards.dtype)  # [N]
    counts = torch.bincount(group, minlength=num_groups).to(rewards.dtype)  # [B]
    wins = rewards.new_zeros(num_groups).index_add_(0, group, success)  # [B]
    return wins, counts - wins


def dbb_advantages(rewards: Tensor, group: Tensor, num_groups: int, *, scale_by_std: bool = True,
                   baseline: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DBB's advantage (arXiv 2603.18444, our reading): relative to the prompt's posterior mean reward μ (the
    `baseline` [B], set from its history by `lit_rlvr.algorithms.prompt_history.PromptHistory`), scaled by the
    posterior predictive std instead of the group's sample std, for ±1 rewards:

        A_i = (r_i − μ) / σ,    σ = √((1 − μ)(1 + μ))    (`scale_by_std=False`: A_i = r_i − μ)

    σ is `beta_mean_std`'s, written in μ: for p̂ ∈ (0, 1) it is > 0, so a group whose rewards are all equal still
    has nonzero advantages (GRPO's would be 0). Without a baseline this is a configuration error: the history part
    is what sets it (a fit with `algorithm.advantages=dbb` adds it).
    """
    if baseline is None:
        raise ValueError("algorithm.advantages=dbb needs each prompt's posterior mean as Rollouts.baseline; the "
                         "PromptHistory part a fit adds for dbb sets it (outside a fit: set rollouts.baseline)")
    mean = baseline.to(rewards.dtype)  # [B]
    adv = rewards - mean[group]  # [N]
    if scale_by_std:
        std = ((1 - mean) * (1 + mean)).clamp_min(0).sqrt()  # [B]
        adv = adv / torch.where(std > 0, std, 1.0)[group]  # [N]
    present = torch.bincount(group, minlength=num_groups) > 0  # [B]
    largest = adv.abs().new_zeros(num_groups).scatter_reduce(0, group, adv.abs(), reduce="amax")  # [B]
    zero = (largest == 0) & present  # [B]
    return adv, {"groups/zero_adv_frac": (zero.sum() / present.sum().clamp_min(1)).detach()}


# -- allocation of a step's extra rollouts at a fixed budget (the rivals of V0.5's OSLA) --------------------------
def uniform_allocation(counts: Sequence[int], total: int, *, k_max: int) -> list[int]:
    """Extra samples per prompt [B] so that the batch's samples total `total` (as far as k_max allows), spread
    evenly: every prompt gets ⌊extra/B⌋ and the first (extra mod B) prompts one more (the batch's order is the
    data's shuffled order, so which prompts get the remainder is arbitrary)."""
    return _fill([1.0] * len(counts), counts, total, k_max=k_max)


def beta_allocation(p_hat: Sequence[float], counts: Sequence[int], total: int, *, k_max: int) -> list[int]:
    """Extra samples per prompt [B] totalling `total` samples in the batch, in proportion to the predicted reward
    std √(p̂(1 − p̂)) of each prompt (`p_hat`: a Beta posterior's mean). Minimising Σ_b p_b(1 − p_b)/n_b, the
    gradient-variance proxy of VIP (arXiv 2602.01601), at a fixed Σ_b n_b gives n_b ∝ √(p_b(1 − p_b)) (Neyman
    allocation); counts already drawn are kept, so the extra samples follow that share as far as they can."""
    return _fill([math.sqrt(max(p * (1 - p), 0.0)) for p in p_hat], counts, total, k_max=k_max)


def _fill(weight: Sequence[float], counts: Sequence[int], total: int, *, k_max: int) -> list[int]:
    """Integer targets n_b ∝ weight_b with Σ n_b = total, each in [counts_b, k_max] (water-filling: prompts at a
    bound are fixed and the rest share what is left; largest remainders, then index order, take the rounding)."""
    room = [max(k_max - c, 0) for c in counts]
    extra_total = max(0, min(total - sum(counts), sum(room)))
    target = [float(c) for c in counts]
    free = [i for i in range(len(counts)) if room[i] > 0]
    budget = float(sum(counts) + extra_total)
    while free:  # fix the prompts whose share falls outside [counts, k_max], then share the rest again
        fixed = sum(target[i] for i in range(len(counts)) if i not in free)
        mass = sum(weight[i] for i in free)
        share = {i: (budget - fixed) * (weight[i] / mass if mass > 0 else 1 / len(free)) for i in free}
        low = [i for i in free if share[i] < counts[i]]
        high = [i for i in free if share[i] > k_max]
        if not low and not high:
            for i in free:
                target[i] = share[i]
            break
        for i in low:
            target[i] = float(counts[i])
        for i in high:
            target[i] = float(k_max)
        free = [i for i in free if i not in low and i not in high]
    extra = [min(int(math.floor(t + 1e-9)) - c, r) for t, c, r in zip(target, counts, room)]
    extra = [max(e, 0) for e in extra]
    left = extra_total - sum(extra)
    order = sorted(range(len(counts)), key=lambda i: (-(target[i] - counts[i] - extra[i]), i))
    while left > 0:
        placed = False
        for i in order:
            if left == 0:
                break
            if extra[i] < room[i]:
                extra[i] += 1
                left -= 1
                placed = True
        if not placed:
            break
    return extra
