"""Reward shaping terms added to the task reward before advantages."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, *, max_len: int, cache_len: int,
                     factor: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO soft overlong punishment (Yu et al. 2025, "DAPO", Eq. 13), added to the reward, scaled by `factor`:

        R_length(y) = 0                                          if |y| <= L_max − L_cache
                    = factor·((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| <= L_max
                    = −factor                                    if |y| > L_max

    so the penalty grows linearly from 0 to −factor over the last `cache_len` tokens before `max_len`.
    Paper: L_max = 20480, L_cache = 4096, factor 1 (Eq. 13 has none; verl's `overlong_buffer.penalty_factor`,
    1.0 by default). `cache_len=0` leaves only the hard −factor past `max_len` (DAPO's module skips this function then:
    `overlong_cache_len=0` switches the shaping off).

    Args: lengths [N] response lengths in tokens. Returns penalty [N] (≤ 0) and `reward/overlong_frac`
    (fraction of responses with a penalty < 0).
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"overlong cache_len must be in [0, max_len={max_len}], got {cache_len}")
    if not factor >= 0:
        raise ValueError(f"overlong penalty factor must be >= 0 (a negative one rewards length), got {factor}")
    lengths = lengths.float()  # [N]
    if cache_len == 0:
        penalty = torch.where(lengths > max_len, -factor, 0.0)  # [N]
    else:
        expected = max_len - cache_len
        penalty = ((expected - lengths) / cache_len * factor).clamp(min=-factor, max=0.0)  # [N]
    return penalty, {"reward/overlong_frac": (penalty < 0).float().mean()}
