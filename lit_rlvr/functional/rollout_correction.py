"""Training-inference mismatch: how far the engine's behaviour log-probs are from the trainer's, and verl's
corrections for it (verl `algorithm.rollout_correction`, `verl/trainer/ppo/rollout_corr_helper.py`, release 0.9.1).

Three policies: π_engine, what the rollout engine sampled from (its log-probs come back with each token);
π_old, the trainer's own log-probs of the same tokens at the same weights; π_θ, the policy being trained. The
per-token log ratio is log r_t = log π_old(y_t) − log π_engine(y_t). References: Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training" (truncated IS, TIS); Liu et al. 2025, "When
Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (sequence-level and
geometric masking, MIS); IcePop (inclusionAI's Ling team 2025: weights outside [lower, upper] are zeroed).

Shapes: N completions, T response tokens; `mask` [N, T] True = the token counts. The tensor functions return
`(value, metrics)` with detached tensor metrics named `mismatch/*`; the threshold parsers raise ValueError.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

SAFETY_BOUND = 20.0  # |log r| is clamped here before exp, as verl does (e^20 ≈ 4.9e8)
IS_LEVELS = ("token", "sequence")
# verl ≥ 0.7 names: <level>_<estimator>; estimator k1 = −log r (ratio bounds), k2 = ½(log r)², k3 = r − 1 − log r
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
# verl ≤ 0.6 names (and the issue's): the same masks as the k1 options they became
RS_ALIASES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
Threshold = Union[float, int, str]


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None


def is_threshold_bounds(threshold: Threshold) -> tuple[float, Optional[float]]:
    """(upper, lower) of an IS threshold as verl parses it: a number C (or "C") truncates weights at C (TIS,
    lower None); a string "a_b" keeps weights in [a, b] and zeroes the rest (IcePop). Both bounds > 0, a ≤ b."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"{threshold!r} is not a number or a 'lower_upper' string")
    text = str(threshold).strip()
    lower_text, _, upper_text = text.partition("_") if "_" in text else ("", "", text)  # verl: split at the first
    upper = _number(upper_text, "upper bound")
    lower = _number(lower_text, "lower bound") if lower_text else None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{threshold!r}: bounds must be > 0 and lower <= upper")
    return upper, lower


def rs_options(modes: str) -> list[str]:
    """verl's option names in `modes` (separated by commas; aliases resolved, duplicates counted once)."""
    options: list[str] = []
    for name in (m.strip() for m in str(modes).split(",") if m.strip()):
        option = RS_ALIASES.get(name, name)
        if option not in RS_OPTIONS:
            raise ValueError(f"{name!r} is not a rejection option; valid: {', '.join([*RS_ALIASES, *RS_OPTIONS])}")
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError("no rejection option given")
    return options


def rs_threshold_bounds(modes: str, threshold: Threshold) -> list[tuple[str, Optional[float], float]]:
    """[(option, lower, upper)] of a rejection spec as verl parses it.

    `modes`: options separated by commas (every one must pass; `rs_options`). `threshold`: one spec for all
    options or one per option, separated by commas. A k1 option takes "lower_upper" or one number C
    (lower = 1/C); k2/k3 options take one upper bound (lower None)."""
    options = rs_options(modes)
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()] if isinstance(threshold, str) else [threshold]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{len(specs)} thresholds for {len(options)} options: give one, or one per option")
    bounds = []
    for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
        if option.endswith("k1"):
            upper, lower = is_threshold_bounds(spec)
            bounds.append((option, 1.0 / upper if lower is None else lower, upper))
        else:
            if isinstance(spec, str) and "_" in spec:
                raise ValueError(f"{option} takes one upper bound, not {spec!r}")
            upper = _number(str(spec), option)
            if upper <= 0:
                raise ValueError(f"{option}: the bound must be > 0, got {spec!r}")
            bounds.append((option, None, upper))
    return bounds


def truncated_is_weights(log_ratio: Tensor, mask: Tensor, *, level: str = "token",
                         threshold: Threshold = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights π_old/π_engine of the sampled tokens, truncated (verl `rollout_is`).

        token:     w_t = exp(clamp(log r_t, ±20))                          one weight per token
        sequence:  w_t = exp(clamp(Σ_t' log r_t', ±20)) for every t        the product of the token ratios
        TIS (threshold C):      w ← min(w, C)                              (Yao et al.; no lower truncation)
        IcePop ("a_b"):         w ← w if a ≤ w ≤ b else 0

    Weights are 0 on padding and carry no gradient. Args: log_ratio = log π_old − log π_engine, mask: [N, T].
    Returns weights [N, T] and `mismatch/is_clip_frac`: the fraction of counted tokens whose weight the
    threshold changed (verl's `rollout_is_ratio_fraction_high`, plus the IcePop zeros below a).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is level {level!r}; valid: {', '.join(IS_LEVELS)}")
    upper, lower = is_threshold_bounds(threshold)
    m = mask.to(log_ratio.dtype)  # [N, T]
    log_ratio = log_ratio.detach()
    if level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True).expand_as(log_ratio)  # [N, T]: Σ_t log r_t
    raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m  # [N, T]
    changed = raw > upper if lower is None else (raw > upper) | (raw < lower)  # [N, T]
    weights = raw.clamp(max=upper) if lower is None else torch.where(changed, torch.zeros_like(raw), raw)
    clip_frac = (changed.to(m.dtype) * m).sum() / m.sum().clamp_min(1.0)
    return weights, {"mismatch/is_clip_frac": clip_frac}


def rejection_mask(log_ratio: Tensor, mask: Tensor, *, modes: str = "token",
                   threshold: Threshold = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Tokens kept by verl's rejection sampling (`rollout_rs`): every option in `modes` must pass.

    Per token, with log r clamped to ±20: k1 = −log r, k2 = ½(log r)², k3 = r − 1 − log r. An option's statistic
    is the token's own (`token_*`), or its sequence's sum, mean or max over counted tokens (`seq_sum_*`,
    `seq_mean_*`, `seq_max_*`; a sequence passes or fails whole). k1 passes when log(lower) ≤ stat ≤ log(upper)
    — bounds on π_engine/π_old, as verl ≥ 0.7 applies them; one number C gives [1/C, C], where the direction
    does not matter; k2 and k3 pass when stat ≤ upper. Aliases: `token` = token_k1 (per-token ratio in
    [1/C, C]), `sequence` = seq_sum_k1 (the sequence's ratio Π_t r_t, Seq-MIS), `geometric` = seq_mean_k1 (its
    geometric mean (Π_t r_t)^(1/|y|), Geo-RS).

    Args: log_ratio = log π_old − log π_engine, mask: [N, T]. Returns keep [N, T] bool (False on padding) and
    `mismatch/rs_masked_frac`: the fraction of counted tokens rejected (verl's `rollout_rs_masked_fraction`).
    """
    bounds = rs_threshold_bounds(modes, threshold)
    mask = mask.bool()
    m = mask.to(log_ratio.dtype)  # [N, T]
    safe = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [N, T]
    per_token = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}  # each [N, T]
    keep = mask.clone()  # [N, T]
    for option, lower, upper in bounds:
        level, estimator = option.rsplit("_", 1)
        stat = per_token[estimator]  # [N, T]
        if level == "seq_sum":
            stat = (stat * m).sum(-1, keepdim=True)  # [N, 1]
        elif level == "seq_mean":
            stat = (stat * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)  # [N, 1]
        elif level == "seq_max":
            stat = stat.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)  # [N, 1]
            stat = torch.where(torch.isinf(stat), torch.zeros_like(stat), stat)  # no counted token: 0
        passed = stat <= upper if lower is None else (stat >= math.log(lower)) & (stat <= math.log(upper))
        keep &= passed  # [N, T] (a sequence statistic broadcasts over its tokens)
    rejected = ((~keep) & mask).to(m.dtype).sum() / m.sum().clamp_min(1.0)
    return keep, {"mismatch/rs_masked_frac": rejected}


def mismatch_metrics(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """How far the engine's log-probs of the sampled tokens are from the trainer's (verl's off-policy metrics).

        mismatch/kl            = mean_t [r_t − 1 − log r_t],  r_t = π_trainer(y_t)/π_engine(y_t)   (k3, verl
                                 `k3_kl`: an unbiased estimate of KL(π_engine ‖ π_trainer) ≥ 0, token mean)
        mismatch/ppl_ratio     = mean_i exp(mean_t log π_engine − mean_t log π_trainer)   (PPL_trainer/PPL_engine
                                 per sequence, then the mean over sequences; verl `ppl_ratio`)
        mismatch/is_weight_max = max_t exp(clamp(log r_t, ±20))   (the largest untruncated token weight)

    All are exact 0, 1, 1 when the engine computes what the trainer computes. The k3 is taken in float64 as
    expm1(log r) − log r: verl's exp(log r) − 1 − log r in float32 rounds exp near 1 to ~6e-8, a noise floor of
    ~1e-9 in the mean that is larger than an fp32 engine's whole drift (|log r| ~ 1e-6, k3 ~ 1e-12); the values
    agree otherwise. trainer_logp, engine_logp, mask: [N, T]. Returns the kl (scalar) and the metrics.
    """
    m = mask.to(trainer_logp.dtype)  # [N, T]
    trainer_logp, engine_logp = trainer_logp.detach(), engine_logp.detach().to(trainer_logp.dtype)
    log_ratio = (trainer_logp - engine_logp) * m  # [N, T]
    count = m.sum().clamp_min(1.0)
    exact = log_ratio.double()  # [N, T]
    kl = ((torch.expm1(exact) - exact) * m.double()).sum().to(trainer_logp.dtype) / count
    lengths = m.sum(-1).clamp_min(1.0)  # [N]
    log_ppl_diff = ((engine_logp - trainer_logp) * m).sum(-1) / lengths  # [N]
    weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).masked_fill(~mask.bool(), float("-inf"))
    return kl, {"mismatch/kl": kl, "mismatch/ppl_ratio": torch.exp(log_ppl_diff).mean(),
                "mismatch/is_weight_max": weights.max() if mask.any() else torch.ones(())}
