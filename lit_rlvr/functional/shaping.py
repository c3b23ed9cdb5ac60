"""Reward shaping terms added to the task reward before advantages."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, *, max_len: int, cache_len: int) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO soft overlong punishment (Yu et al. 2025, "DAPO", Eq. 13), added to the reward:

        R_length(y) = 0                              if |y| <= L_max − L_cache
                    = ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| <= L_max
                    = −1                             if |y| > L_max

    so the penalty grows linearly from 0 to −1 over the last `cache_len` tokens before `max_len`.
    Paper: L_max = 20480, L_cache = 4096. `cache_len=0` switches the shaping off.

    Args: lengths [N] response lengths in tokens. Returns penalty [N] (≤ 0) and `reward/overlong_frac`
    (fraction of responses inside the penalty zone or beyond).
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"overlong cache_len must be in [0, max_len={max_len}], got {cache_len}")
    lengths = lengths.float()  # [N]
    if cache_len == 0:
        penalty = torch.where(lengths > max_len, -1.0, 0.0)  # [N]
    else:
        expected = max_len - cache_len
        penalty = ((expected - lengths) / cache_len).clamp(min=-1.0, max=0.0)  # [N]
    return penalty, {"reward/overlong_frac": (penalty < 0).float().mean()}
