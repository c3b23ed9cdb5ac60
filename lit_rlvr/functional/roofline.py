"""The roofline of a phase: the least time the hardware allows for its model FLOPs and the bytes it must read.

With a peak of Π FLOP/s and a memory bandwidth of β bytes/s, work of F FLOPs that reads B bytes takes at least

    T(F, B) = max(F / Π, B / β)

(Williams et al. 2009, "Roofline"). A phase's `of_roofline` = T / its measured seconds: 1 on the bound, lower
the further from it (the MFU is F / seconds / Π, the MBU B / seconds / β; of_roofline is the larger of the two).

Prefill and the update multiply matrices of many rows at once: their FLOPs per byte read are far above Π / β, so
their bound is F / Π. Decode is taken step by step, since the rows alive change its balance: decode step j
(1 ≤ j ≤ D) of a batch feeds one token per row i still decoding (r_i − 1 ≥ j, r_i its response length, p_i its
prompt's), reads every weight once (P parameters of b bytes) and each such row's p_i + j cached positions
(κ = 2·L·K·e·b bytes each, a key and a value per layer and KV head), and computes F(1, p_i + j − 1, 1) per row
(`flops.forward_flops`):

    F_j = Σ_i∈alive(j) [2·W + 2·d·V + 4·L·H·e·(p_i + j)]
    B_j = P·b + κ · Σ_i∈alive(j) (p_i + j)
    T_decode = Σ_j max(F_j / Π, B_j / β)

W = L·(2·d·H·e + 2·d·K·e + 3·d·I) as in `flops`. The KV writes and activations are left out (they count low),
and one batch holds every row (an engine that splits it reads the weights more often than counted).
"""

from __future__ import annotations

import torch
from torch import Tensor


def roofline_seconds(flops: float, bytes_read: float, *, peak_flops: float, peak_bandwidth: float) -> float:
    """T(F, B) = max(F / Π, B / β) of the module docstring."""
    if peak_flops <= 0 or peak_bandwidth <= 0:
        raise ValueError(f"peak_flops {peak_flops!r} and peak_bandwidth {peak_bandwidth!r}: both must be > 0")
    return max(float(flops) / peak_flops, float(bytes_read) / peak_bandwidth)


def decode_roofline(prompt_lengths: Tensor, response_lengths: Tensor, *, parameters: int, dtype_bytes: int,
                    peak_flops: float, peak_bandwidth: float, layers: int, hidden: int, intermediate: int, heads: int,
                    kv_heads: int, head_dim: int, vocab: int) -> tuple[float, dict[str, float]]:
    """T_decode of the module docstring for completions with these prompt and response lengths ([N] each; a
    response of r tokens has r − 1 decode steps, its first token comes from the prefill).

    Returns (seconds, {"flops": Σ F_j, "bytes": Σ B_j, "compute_s": Σ F_j / Π, "memory_s": Σ B_j / β,
    "steps": D, "memory_bound_steps": the steps whose bytes set the bound})."""
    if peak_flops <= 0 or peak_bandwidth <= 0:
        raise ValueError(f"peak_flops {peak_flops!r} and peak_bandwidth {peak_bandwidth!r}: both must be > 0")
    p = prompt_lengths.to(torch.float64)  # [N]
    steps = (response_lengths.to(torch.float64) - 1).clamp_min(0)  # [N]
    decode_steps = int(steps.max()) if len(steps) else 0
    j = torch.arange(1, decode_steps + 1, dtype=torch.float64)  # [D]
    alive = (steps[None, :] >= j[:, None]).to(torch.float64)  # [D, N]
    positions = (alive * (p[None, :] + j[:, None])).sum(-1)  # [D] Σ_alive (p_i + j)
    rows = alive.sum(-1)  # [D]
    per_row = 2.0 * layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                              + 3 * hidden * intermediate) + 2.0 * hidden * vocab  # 2·W + 2·d·V
    flops = per_row * rows + 4.0 * layers * heads * head_dim * positions  # [D] F_j
    kv_bytes = 2.0 * layers * kv_heads * head_dim * dtype_bytes  # κ
    bytes_read = float(parameters) * dtype_bytes + kv_bytes * positions  # [D] B_j
    compute, memory = flops / peak_flops, bytes_read / peak_bandwidth  # [D]
    seconds = float(torch.maximum(compute, memory).sum())
    return seconds, {"flops": float(flops.sum()), "bytes": float(bytes_read.sum()), "compute_s": float(compute.sum()),
                     "memory_s": float(memory.sum()), "steps": float(decode_steps),
                     "memory_bound_steps": float((memory > compute).sum())}
