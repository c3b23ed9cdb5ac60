"""Edges of lit_rlvr/functional/ that the mutation run (scripts/mutation.py, docs/mutation.md) found unchecked,
each against a hand-worked number."""

from __future__ import annotations

import torch

from lit_rlvr import functional as F


def test_zero_adv_frac_of_a_single_group():
    """One group, constant: 1 of 1 groups has zero advantage (the denominator is the count of groups present)."""
    _, metrics = F.grpo_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), 1)
    assert metrics["groups/zero_adv_frac"].item() == 1.0
    _, metrics = F.grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), 1)
    assert metrics["groups/zero_adv_frac"].item() == 0.0


def test_partial_chunks_count_only_chunks_that_have_completions():
    """Prompt 0: all its completions from chunk 0, one a success; chunk 1 generated none for it, so it is not
    partial. Prompt 1: chunk 0 has the success, chunk 1 has one completion (a failure): partial. 1 of 2 groups
    with a success is partial."""
    success = torch.tensor([True, False, False, True, False])
    group = torch.tensor([0, 0, 1, 1, 1])
    chunk = torch.tensor([0, 0, 0, 0, 1])
    partial, metrics = F.partial_chunk_success(success, group, chunk, 2, 2)
    assert partial.tolist() == [False, True]
    assert metrics["groups/partial_chunk_frac"].item() == 0.5
