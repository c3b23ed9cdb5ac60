"""Bookkeeping over weight-sample chunks of a group (3PO, docs/architecture.md §5).

3PO generates a prompt's G completions from several posterior weight samples ("chunks"): C3PO pools them into
one group of G, M3PO keeps each chunk of G/M as its own advantage group. Shapes: N completions, B prompts,
C chunks; `group` [N] long in [0, B), `chunk` [N] long in [0, C).
"""

from __future__ import annotations

import torch
from torch import Tensor


def chunk_groups(group: Tensor, chunk: Tensor, num_chunks: int) -> Tensor:
    """Advantage group id of each completion when every (prompt, chunk) pair is its own group (M3PO):
    b·C + c, in [0, B·C). group, chunk: [N] long -> [N] long."""
    return group * num_chunks + chunk


def partial_chunk_success(
    success: Tensor, group: Tensor, chunk: Tensor, num_groups: int, num_chunks: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """Groups whose successes come from only some of their chunks.

    A group with at least one success is *partial* when one of the chunks it has completions from has none.
    With one chunk nothing is partial. In C3PO a partial group is one where a weight sample other than the rest
    found the answer — the groups parameter noise rescues (3PO paper, "dead group" analysis).

    Args: success [N] bool; group, chunk [N] long.
    Returns: partial [B] bool; `groups/partial_chunk_frac` = partial groups / groups with a success (0 if none).
    """
    cell = chunk_groups(group, chunk, num_chunks)  # [N] in [0, B·C)
    size = num_groups * num_chunks
    # [B, C]
    wins = torch.zeros(size, dtype=torch.long).index_add_(0, cell, success.long()).view(num_groups, num_chunks)
    present = (torch.bincount(cell, minlength=size) > 0).view(num_groups, num_chunks)  # [B, C]
    any_win = wins.sum(-1) > 0  # [B]
    every_chunk_wins = ((wins > 0) | ~present).all(-1)  # [B] chunks without completions do not count
    partial = any_win & ~every_chunk_wins  # [B]
    frac = partial.sum().float() / any_win.sum().clamp_min(1).float()
    return partial, {"groups/partial_chunk_frac": frac.detach()}
