"""Model FLOPs of a decoder-only transformer's forwards: what one RL step's generation and update compute.

Model FLOPs count the matrix multiplies a step needs for its real tokens (Chowdhery et al. 2022, "PaLM", App. B;
Narayanan et al. 2021): 2 FLOPs per multiply-add, padding excluded, elementwise work (norms, rotary, softmax,
activations, the optimizer) left out. For a model with L layers, hidden size d, MLP width I (gated: gate, up and
down projections), H query heads and K key/value heads of size e, vocabulary V:

    W = L·(2·d·H·e + 2·d·K·e + 3·d·I)       multiply-adds of the projections per position (q, o; k, v; MLP)

A forward over n new positions of a row whose cache already holds c positions, with the LM head at k positions:

    F(n, c, k) = 2·W·n                      the projections
               + 2·d·V·k                    the LM head (tied or not: the same matmul)
               + 4·L·H·e·(n·c + n(n+1)/2)   attention: QKᵀ and AV, each 2·H·e per (query, key) pair,
                                            new position j (1..n) attending to its c + j keys (causal)

The embedding lookup is a gather (0 FLOPs). A backward costs twice its forward (the gradients of each matmul's
two inputs), so a forward + backward is 3·F.

LoRA adapters (rank r on a layer [out, in]: x·Aᵀ then ·Bᵀ) add r·(in + out) multiply-adds per position, their
parameter count; P = that summed over the adapted layers, so a forward adds 2·P per position. With the base
frozen, the backward of its matmuls computes the input gradients only (no weight gradients): projections and head
cost 2·F in all, attention (no weights) still 3·F, the adapters 3·2·P per position.

Decode is bound by memory traffic rather than FLOPs: `generation_bytes` counts what generation must read (the
weights once per forward of the batch, the KV cache at every decode step), for the memory-bandwidth utilisation.
"""

from __future__ import annotations

import torch
from torch import Tensor

SHAPE_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")


def forward_flops(new: Tensor, cached: Tensor, head: Tensor, *, layers: int, hidden: int, intermediate: int,
                  heads: int, kv_heads: int, head_dim: int, vocab: int) -> tuple[Tensor, dict[str, Tensor]]:
    """F(n, c, k) of the module docstring summed over rows: new, cached, head [R] (positions per row).

    Returns (FLOPs [] float64, {"linear", "head", "attention"}: its three terms)."""
    n, c, k = (x.to(torch.float64) for x in (new, cached, head))  # [R]: float64, exact to 2^53
    attention_proj = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    per_position = layers * (attention_proj + 3 * hidden * intermediate)  # W
    linear = 2.0 * per_position * n.sum()
    head_flops = 2.0 * hidden * vocab * k.sum()
    pairs = (n * c + n * (n + 1) / 2).sum()  # (query, key) pairs of the causal new positions
    attention = 4.0 * layers * heads * head_dim * pairs
    return linear + head_flops + attention, {"linear": linear, "head": head_flops, "attention": attention}


def generation_flops(prefill_lengths: Tensor, prompt_lengths: Tensor, response_lengths: Tensor, *, adapter: int = 0,
                     layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                     vocab: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Model FLOPs of sampling: each prefill, then each completion's decode steps.

    prefill_lengths [U]: the prompts prefilled (one per distinct prompt and weight source of an engine call, as
    `HFEngine` shares a group's prefill), F(p, 0, 1) each: the LM head runs at the last position only.
    prompt_lengths, response_lengths [N]: per completion of r tokens, the first comes from the prefill's logits
    and r − 1 decode steps feed the others one by one: F(r − 1, p, r − 1) (token j, 1 ≤ j < r, sees p + j keys).
    `adapter`: P of an engine that runs LoRA adapters unmerged (0 for merged weights), 2·P per position.
    Returns (FLOPs [] float64, {"prefill", "decode"})."""
    shape = dict(layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                 head_dim=head_dim, vocab=vocab)
    prefill, _ = forward_flops(prefill_lengths, torch.zeros_like(prefill_lengths), torch.ones_like(prefill_lengths),
                               **shape)
    steps = (response_lengths - 1).clamp_min(0)  # [N]
    decode, _ = forward_flops(steps, prompt_lengths, steps, **shape)
    prefill = prefill + 2.0 * adapter * prefill_lengths.to(torch.float64).sum()
    decode = decode + 2.0 * adapter * steps.to(torch.float64).sum()
    return prefill + decode, {"prefill": prefill, "decode": decode}


def update_flops(prompt_lengths: Tensor, response_lengths: Tensor, *, passes: int = 1, reference: bool = False,
                 recompute: bool = False, old_forward: bool = False, adapter: int = 0, layers: int, hidden: int,
                 intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 vocab: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Model FLOPs of the update over completions with these prompt and response lengths ([N] each).

    Each of `passes` passes over the batch (PPO epochs; M3PO's per-sample loss passes split a batch, they do not
    repeat it) runs a forward + backward over prompt and response, the LM head at the response positions:
    3·F(p + r, 0, r), or with LoRA adapters (`adapter` = P > 0, the base frozen) 2·F + F_attention + 6·P per
    position. `reference`: a frozen reference model's forward (KL penalty; LoRA's is the base without adapters),
    F(p + r, 0, r) per pass. `recompute`: activation checkpointing runs the decoder layers' forward again in the
    backward, F(p + r, 0, 0) (+ 2·P) per pass. `old_forward`: the decoupled rollout correction's one forward for
    π_old before the passes, F(p + r, 0, r) (+ 2·P).
    Returns (FLOPs [] float64, {"forward_backward", "reference", "recompute", "old_forward"})."""
    shape = dict(layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                 head_dim=head_dim, vocab=vocab)
    zero = torch.zeros_like(prompt_lengths)
    tokens = prompt_lengths + response_lengths  # [N]
    forward, terms = forward_flops(tokens, zero, response_lengths, **shape)
    body, _ = forward_flops(tokens, zero, zero, **shape)
    lora = 2.0 * adapter * tokens.to(torch.float64).sum()  # the adapters' forward
    forward_backward = 2.0 * forward + terms["attention"] + 3.0 * lora if adapter else 3.0 * forward
    parts = {"forward_backward": passes * forward_backward,
             "reference": passes * forward * float(reference),
             "recompute": passes * (body + lora) * float(recompute),
             "old_forward": (forward + lora) * float(old_forward)}
    return sum(parts.values()), parts


KV_SHAPE_KEYS = ("layers", "kv_heads", "head_dim")


def generation_bytes(prefill_lengths: Tensor, prompt_lengths: Tensor, response_lengths: Tensor, source: Tensor, *,
                     parameters: int, dtype_bytes: int, layers: int, kv_heads: int,
                     head_dim: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Bytes a generated batch must read from memory (and prefill's KV cache write): what its memory-bandwidth
    utilisation (MBU) divides by the seconds. With P parameters and the KV cache in the engine's dtype of b =
    `dtype_bytes` bytes, the cache holding κ = 2·L·K·e·b bytes per position (a key and a value per layer and KV
    head):

        weights  = P·b · Σ_s (1 + D_s)                  one prefill forward and D_s decode steps per weight
                                                        source s, each reading every weight once for all the
                                                        batch's rows
        kv_write = κ · Σ_u p_u                          each prefill writes its prompt's keys and values
        kv_read  = κ · Σ_i ((r_i − 1)·p_i + (r_i − 1)·r_i / 2)
                                                        decode step j (1 ≤ j < r) of a completion attends to
                                                        p + j positions (p its prompt, r its response length)

    D_s = max over the completions of source s of (r − 1): the HF engine decodes a batch until its longest row
    ends (rows that end early leave it in blocks, the batch's forwards go on), so the weight reads follow the
    longest completion, not the sum of the rows. Approximations, all small or counting low:
    * an engine that splits the rows into several batches (more rows than its `max_batch`) reads the weights once
      per batch and step: D_s counts low there;
    * the KV reads count each completion up to its own end, and real positions only: a finished row decoded
      until a row cut drops it, a left-padded prompt's padding and the cache's room are read by the kernel too;
    * the embedding matrix counts among the P (untied, a decode step gathers one row of it);
    * activations, logits and the decode steps' KV writes (one position per row and step) are left out;
    * under autocast (bf16-mixed, an engine in the trainer's process) the cache is in the compute dtype, counted
      at b.

    prefill_lengths [U] (as `generation_flops`), prompt_lengths, response_lengths, source [N] (the weight source
    of each completion, `Rollouts.source`). Returns (bytes [] float64, {"weights", "kv_write", "kv_read"})."""
    p, r = prompt_lengths.to(torch.float64), response_lengths.to(torch.float64)  # [N]
    per_position = 2.0 * layers * kv_heads * head_dim * dtype_bytes  # κ
    steps = (r - 1).clamp_min(0)  # [N]
    if len(steps):
        longest = torch.zeros(int(source.max()) + 1, dtype=torch.float64).scatter_reduce(
            0, source.long(), steps, "amax")  # [S] D_s
        forwards = (1.0 + longest).sum()
    else:
        forwards = torch.tensor(0.0, dtype=torch.float64)
    weights = float(parameters) * dtype_bytes * forwards
    kv_write = per_position * prefill_lengths.to(torch.float64).sum()
    kv_read = per_position * (steps * p + steps * (steps + 1) / 2).sum()
    return weights + kv_write + kv_read, {"weights": weights, "kv_write": kv_write, "kv_read": kv_read}
