"""V0.5 math: empirical shrinkage fusion of a value prior with a few rollouts, and OSLA budget allocation.

Paper: "V0.5: Generalist Value Model as a Prior for Sparse RL Rollouts" (summary in shared/seeds/).
Rewards are in {-1, +1}; the prior is on the reward scale, `V = 2·p̂ - 1`; after k rollouts of a prompt the
sample mean is v̄_k; σ² is the reward noise variance (1 for ±1 rewards, the worst case).

Shapes: B prompts (one group each). Every function here is pure, takes tensors plus keyword
hyperparameters, never calls `.item()` and returns detached metrics.

Edge cases (ours, not the paper's):
* a non-finite prior (NaN: "no prior for this prompt") is treated as infinitely biased, so the baseline
  is the plain sample mean (w = 1) and OSLA asks for samples as the plain mean would;
* a prompt with 0 samples has no data: its baseline is the prior and OSLA always wants a first sample.
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor


def reward_noise_var(low: float = -1.0, high: float = 1.0) -> float:
    """Worst-case variance of a reward bounded in [low, high]: (high - low)² / 4 (= 1 for ±1 rewards)."""
    if high <= low:
        raise ValueError(f"reward range must have high > low, got low={low}, high={high}")
    return (high - low) ** 2 / 4


def _squared_bias(sample_mean: Tensor, prior: Tensor, counts: Tensor, noise_var: float) -> Tensor:
    """Δ̂² = max(0, (v̄_k - V)² - σ²/k), [B]; +inf where the prior is missing (non-finite)."""
    k = counts.to(sample_mean.dtype).clamp_min(1)  # [B] 0 samples handled by callers
    excess = (sample_mean - prior).square() - noise_var / k  # [B] squared gap beyond what noise explains
    bias_sq = excess.clamp_min(0)  # [B]
    return torch.where(torch.isfinite(prior), bias_sq, torch.full_like(bias_sq, float("inf")))  # [B]


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


def baseline_mse(sample_mean: Tensor, prior: Tensor, counts: Tensor, *, noise_var: float = 1.0) -> Tensor:
    """Estimated MSE of the fused baseline after k samples (V0.5, Eq. 12, inferred form), [B]:

        MSE(k) = σ²·Δ̂² / (k·Δ̂² + σ²) = σ² / (k + σ²/Δ̂²)

    Δ̂² = 0 (prior not rejected) gives 0; a missing prior (Δ̂² = ∞) gives σ²/k, the plain mean's variance.
    """
    k = counts.to(sample_mean.dtype)  # [B]
    bias_sq = _squared_bias(sample_mean, prior, counts, noise_var)  # [B]
    ratio = noise_var / bias_sq  # [B] σ²/Δ̂²: +inf when unrejected, 0 when missing
    return noise_var / (k + ratio)  # [B]


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


# -- the same math in plain Python on float32 values ------------------------------------------------------------
# The callback's per-step path (the fusion once, the OSLA round 1-3 times) works on B, a few dozen, numbers: there
# even numpy's per-call overhead (~10-20 µs a call with the caches cold after the policy's step) is the cost.
# Plain Python on float32 values, each operation rounded to float32 (`round_f32`), gives the torch functions'
# bits: for + − × ÷ on float32 inputs the float64 result rounded once more to float32 is the correctly rounded
# float32 result (53 ≥ 2·24 + 2 bits). tests/test_value_prior_functional.py checks it on random inputs.
_F32 = struct.Struct("<f")


def round_f32(x: float) -> float:
    """x rounded to the nearest float32 (inf where float32 overflows)."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # the correctly rounded result is ±inf
        return math.copysign(math.inf, x)


def _div(a: float, b: float) -> float:
    """IEEE a / b (Python raises on b = 0 where IEEE gives ±inf or nan), rounded to float32."""
    if b == 0:
        return math.nan if a == 0 or a != a else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return round_f32(a / b)


def group_mean_py(values: list[float], group: list[int], num_groups: int) -> tuple[list[float], list[int]]:
    """`advantages.group_mean` in plain Python, with the counts: the mean of `values` [N] within each group [B]
    (float64 sums, exact for ±1 rewards, rounded to float32; 0 for an empty group) and each group's size [B]."""
    sums, counts = [0.0] * num_groups, [0] * num_groups
    for v, g in zip(values, group):
        sums[g] += v
        counts[g] += 1
    return [round_f32(s / max(n, 1)) for s, n in zip(sums, counts)], counts


def expected_mse_reduction_py(mean: list[float], prior: list[float], counts: list[int],
                              noise_var: float) -> list[float]:
    """`expected_mse_reduction` in plain Python on float32 values (same operations, same bits), [B]."""
    nv = round_f32(noise_var)
    out = []
    for m, p, c in zip(mean, prior, counts):
        if c <= 0:
            out.append(math.inf)
            continue
        k = float(c)
        diff = round_f32(m - p)
        # torch evaluates `scalar / tensor` as scalar · (1 / tensor) in float32: written so, for the same bits
        excess = round_f32(round_f32(diff * diff) - round_f32(nv * _div(1.0, max(k, 1.0))))
        bias_sq = (0.0 if excess < 0 else excess) if math.isfinite(p) else math.inf  # NaN stays NaN, as clamp_min
        ratio = round_f32(nv * _div(1.0, bias_sq))
        now = round_f32(nv * _div(1.0, round_f32(k + ratio)))  # σ²/(k + σ²/Δ̂²)
        after = round_f32(nv * _div(1.0, round_f32(round_f32(k + 1.0) + ratio)))  # with one sample more
        out.append(round_f32(now - after))
    return out


def shrinkage_fusion_py(mean: list[float], prior: list[float], counts: list[int],
                        noise_var: float) -> tuple[list[float], dict[str, list]]:
    """`shrinkage_fusion` in plain Python on float32 values (same operations, same bits): the baseline [B] and
    its metrics {"w", "bias_sq", "prior_rejected", "prior_missing"} [B]."""
    nv = round_f32(noise_var)
    baseline, metrics = [], {"w": [], "bias_sq": [], "prior_rejected": [], "prior_missing": []}
    for m, p, c in zip(mean, prior, counts):
        has_prior, has_data = math.isfinite(p), c > 0
        noise = round_f32(nv * _div(1.0, max(float(c), 1.0)))  # σ²/k as torch's `scalar / tensor`
        diff = round_f32(m - p)
        excess = round_f32(round_f32(diff * diff) - noise)
        bias_sq = (0.0 if excess < 0 else excess) if has_prior else math.inf  # NaN stays NaN, as clamp_min
        w = (1.0 if math.isinf(bias_sq) else _div(bias_sq, round_f32(bias_sq + noise))) if has_data else 0.0
        fused = round_f32(p + round_f32(w * diff)) if has_data else p
        baseline.append(fused if has_prior else m)
        metrics["w"].append(w)
        metrics["bias_sq"].append(bias_sq if has_data else 0.0)
        metrics["prior_rejected"].append(has_data and has_prior and bias_sq > 0)
        metrics["prior_missing"].append(not has_prior)
    return baseline, metrics


def allocate_round_py(wants_more: list[bool], gain: list[float], counts: list[int], *, k_max: int,
                      min_active_frac: float, pad_to: int, round_size: int) -> list[int]:
    """`allocate_round` in plain Python (same rules, same allocation), [B]."""
    room = [max(k_max - c, 0) for c in counts]
    active = [w and r > 0 for w, r in zip(wants_more, room)]
    if not (any(active) and sum(active) >= min_active_frac * len(counts)):
        return [0] * len(counts)
    extra = [min(r, round_size) if a else 0 for a, r in zip(active, room)]
    padding = -sum(extra) % pad_to  # sequences to add so the round is a multiple of pad_to
    # _place_padding: pass p offers one slot to every prompt with room ≥ p, best gain first (ties by index)
    order = sorted(range(len(counts)), key=lambda i: math.inf if gain[i] != gain[i] else -gain[i])
    placed = [0] * len(counts)
    for p in range(1, max(k_max, 0) + 1):
        for i in order:
            if padding == 0:
                return [e + q for e, q in zip(extra, placed)]
            if room[i] - extra[i] >= p:
                placed[i] += 1
                padding -= 1
    return [e + q for e, q in zip(extra, placed)]
