"""V0.5 math: empirical shrinkage fusion of a value prior with a few rollouts, and OSLA budget allocation.

Paper: "V0.5: Generalist Value Model as a Prior for Sparse RL Rollouts" (docs/architecture.md §6).
Rewards are in {-1, +1}; the prior is on the reward scale, `V = 2·p̂ - 1`; after k rollouts of a prompt the
sample mean is v̄_k; σ² is the reward noise variance (1 for ±1 rewards, the worst case).

Shapes: B prompts (one group each). Every function here is pure. The per-step ones (fusion, OSLA, round
allocation: what `callbacks.ValuePrior` runs) take lists of float32 values, for speed at B of a few dozen;
`baseline_mse` (the oracle baseline's metric) takes tensors.

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


def baseline_mse(sample_mean: Tensor, prior: Tensor, counts: Tensor, *, noise_var: float = 1.0) -> Tensor:
    """Estimated MSE of the fused baseline after k samples (V0.5, Eq. 12, inferred form), [B]:

        MSE(k) = σ²·Δ̂² / (k·Δ̂² + σ²) = σ² / (k + σ²/Δ̂²)

    Δ̂² = 0 (prior not rejected) gives 0; a missing prior (Δ̂² = ∞) gives σ²/k, the plain mean's variance.
    """
    k = counts.to(sample_mean.dtype)  # [B]
    bias_sq = _squared_bias(sample_mean, prior, counts, noise_var)  # [B]
    ratio = noise_var / bias_sq  # [B] σ²/Δ̂²: +inf when unrejected, 0 when missing
    return noise_var / (k + ratio)  # [B]


# -- the per-step math in plain Python on float32 values -------------------------------------------------------
# The callback's per-step path (the fusion once, the OSLA round 1-3 times) works on B, a few dozen, numbers: there
# even numpy's per-call overhead (~10-20 µs a call with the caches cold after the policy's step) is the cost.
# Plain Python on float32 values, each operation rounded to float32 (`round_f32`), gives float32 torch's bits:
# for + − × ÷ on float32 inputs the float64 result rounded once more to float32 is the correctly rounded float32
# result (53 ≥ 2·24 + 2 bits). tests/test_value_prior_functional.py checks each function against its tensor form
# (tests/v05_tensor_oracles.py) on random inputs, bit for bit.
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


def expected_mse_reduction(mean: list[float], prior: list[float], counts: list[int],
                           noise_var: float) -> list[float]:
    """MSE(k) − MSE(k+1) with Δ̂² held at its current estimate (V0.5, Eq. 12, inferred form), [B]:

        MSE(k) = σ²·Δ̂² / (k·Δ̂² + σ²) = σ² / (k + r),   r = σ²/Δ̂²

    At most σ²/(k(k+1)) (missing or far-off prior), 0 when the prior is not rejected, +inf for k = 0 (no data
    yet: always worth a first sample). `mean` v̄_k, `prior` V (NaN: none), `counts` k per prompt.
    """
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


def shrinkage_fusion(mean: list[float], prior: list[float], counts: list[int],
                     noise_var: float) -> tuple[list[float], dict[str, list]]:
    """Fuse the prior V with the sample mean v̄_k of k rollouts (V0.5, Eq. 8, empirical shrinkage), [B]:

        Δ̂² = max(0, (v̄_k − V)² − σ²/k)      estimated squared bias of the prior
        w  = Δ̂² / (Δ̂² + σ²/k)               weight on the data, in [0, 1)
        b  = w·v̄_k + (1 − w)·V               fused baseline (computed as V + w·(v̄_k − V))

    Guarantees: b = V exactly when (v̄_k − V)² ≤ σ²/k (the data cannot reject the prior), and |b − v̄_k| ≤ σ/√k
    always. `mean` v̄_k (reward scale; ignored where k = 0), `prior` V (NaN = no prior: b = v̄_k), `counts` k ≥ 0
    (k = 0 gives b = V), `noise_var` σ² (see `reward_noise_var`). Returns the baseline and the metrics
    {"w", "bias_sq" (Δ̂², 0 without data), "prior_rejected" (Δ̂² > 0), "prior_missing"}, [B] each.
    """
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


def osla_wants_more(gain: list[float], counts: list[int], *, cost: float, k_max: int) -> list[bool]:
    """One-step look-ahead stopping rule (V0.5, Eq. 12, inferred form), [B]: ask for sample k+1 iff
    MSE(k) − MSE(k+1) = `gain` (from `expected_mse_reduction`) > c, and never past k_max. With c = 0.0039 ≈ 1/256
    and a far-off prior the gain is ≈ 1/(k(k+1)), which stays above c up to k = 15: 16 is the natural cap."""
    return [g > cost and k < k_max for g, k in zip(gain, counts)]


def allocate_round(wants_more: list[bool], gain: list[float], counts: list[int], *, k_max: int,
                   min_active_frac: float, pad_to: int, round_size: int) -> list[int]:
    """Extra samples per prompt for the next round of rollouts (V0.5 batch rules), [B].

    From the paper: keep generating only while at least `min_active_frac` of the batch's prompts still ask for
    samples (`wants_more`, from `osla_wants_more`), and pad each round's request to a multiple of `pad_to`
    sequences. *(inferred)*: an active prompt gets `round_size` more samples (capped at k_max); the padding goes
    one sample at a time to the prompts of largest `gain` (NaN lowest; one padding sample per prompt per pass,
    passes repeat until it is placed); no prompt goes past k_max, so padding that does not fit is dropped.
    """
    if round_size < 1 or pad_to < 1 or not 0.0 <= min_active_frac <= 1.0:
        raise ValueError(f"allocate_round needs round_size ≥ 1, pad_to ≥ 1 and 0 ≤ min_active_frac ≤ 1; got "
                         f"round_size={round_size}, pad_to={pad_to}, min_active_frac={min_active_frac}")
    room = [max(k_max - c, 0) for c in counts]
    active = [w and r > 0 for w, r in zip(wants_more, room)]
    if not (any(active) and sum(active) >= min_active_frac * len(counts)):
        return [0] * len(counts)
    extra = [min(r, round_size) if a else 0 for a, r in zip(active, room)]
    padding = -sum(extra) % pad_to  # sequences to add so the round is a multiple of pad_to
    # pass p offers one slot to every prompt with room ≥ p, best gain first (ties by index)
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
