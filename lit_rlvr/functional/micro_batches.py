"""How the update loop splits a batch of sequences into micro-batches (one forward/backward each).

Fixed size: `micro_batch_size` rows in batch order. Token budget (verl's dynamic batch size,
`use_dynamic_bsz` / `ppo_max_token_len_per_gpu`): rows sorted by length, longest first, and packed into
micro-batches whose padded size stays within a token count. A micro-batch is padded to its longest row, so
with lengths spread from 30 to 250 tokens a fixed split pays for up to ~8× the real tokens; grouping rows of
similar length keeps the padding small, and a budget in tokens (instead of rows) keeps the memory of each
forward about constant whatever the lengths. The gradient does not change: the module weighs each
micro-batch's loss by its share of the whole pass, so any partition sums to the same loss.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def micro_batches(
    lengths: Tensor, *, max_rows: int, max_tokens: Optional[int] = None, width: Optional[int] = None
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Index tensors ([m] long) of the micro-batches of N rows of `lengths` ([N] tokens of each row, the
    padding it will be trimmed to excluded), and metrics.

    `max_tokens` None: consecutive rows, `max_rows` at a time (the fixed split). Otherwise rows in order of
    decreasing length (ties in batch order), packed greedily: a micro-batch starts at the longest row left and
    takes the next ones while rows × its longest length ≤ `max_tokens` and rows ≤ `max_rows`. Its padded size
    L_max · rows is what the forward costs. A row longer than `max_tokens` forms a micro-batch alone (the
    budget cannot be kept, but no row is dropped). `width`: the columns every micro-batch is computed at when
    they are not trimmed to their longest row (the fixed split pads all to the batch's width); None = trimmed.

    Metrics: `micro/count` micro-batches, `micro/padding_frac` = 1 − Σ lengths / Σ_micro (rows · L_max)
    (L_max = `width` when given), the share of computed positions that are padding.
    """
    if max_rows < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"micro_batches: max_rows and max_tokens must be >= 1, got {max_rows}, {max_tokens}")
    count = lengths.shape[0]
    if max_tokens is None:
        micros = list(torch.arange(count).split(max_rows))
    else:
        order = torch.sort(lengths, descending=True, stable=True).indices  # [N] longest first
        sizes, rows, longest = [], 0, 0
        for length in lengths[order].tolist():  # one sync: the partition is host-side bookkeeping
            if rows and (rows == max_rows or (rows + 1) * longest > max_tokens):
                sizes.append(rows)
                rows = 0
            longest = length if rows == 0 else longest
            rows += 1
        if rows:
            sizes.append(rows)
        micros = list(order.split(sizes))
    padded = sum(len(m) * (width or int(lengths[m].max())) for m in micros if len(m))
    real = float(lengths.sum())
    metrics = {"micro/count": torch.tensor(float(len(micros))),
               "micro/padding_frac": torch.tensor(1.0 - real / padded if padded else 0.0)}
    return micros, metrics
