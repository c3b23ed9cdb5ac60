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


def test_osla_asks_only_for_a_gain_strictly_above_the_cost_and_below_k_max():
    """MSE(k) − MSE(k+1) = c exactly is not worth a sample (Eq. 12: gain > c); one float step above is; k = k_max
    never asks, k_max − 1 may."""
    import math

    from lit_rlvr.functional.value_prior import osla_wants_more

    c = 0.0039
    above = math.nextafter(c, 1.0)
    assert osla_wants_more([c, above, 0.5, 0.5], [4, 4, 16, 15], cost=c, k_max=16) == [False, True, False, True]


def test_allocate_round_at_its_boundaries():
    """Hand-worked, with the rules of `allocate_round`: an active prompt gets min(room, round_size); the round is
    padded to a multiple of pad_to one sample per prompt per pass, best gain first (NaN last); no prompt passes
    k_max; the round happens only while ≥ min_active_frac of the prompts ask."""
    from lit_rlvr.functional.value_prior import allocate_round

    kw = dict(k_max=16, round_size=1)
    one_of_four = dict(wants_more=[True, False, False, False], gain=[0.1, 0.0, 0.0, 0.0], counts=[4, 4, 4, 4])
    assert allocate_round(**one_of_four, min_active_frac=0.25, pad_to=1, **kw) == [1, 0, 0, 0]  # 1 ≥ 0.25·4
    assert allocate_round(**one_of_four, min_active_frac=0.26, pad_to=1, **kw) == [0, 0, 0, 0]  # 1 < 1.04
    two = dict(wants_more=[True, True], counts=[4, 4], min_active_frac=0.0, **kw)
    # 2 asked, pad_to 5: 3 more, passes give prompt 0 (gain 0.5), prompt 1, prompt 0
    assert allocate_round(gain=[0.5, 0.2], pad_to=5, **two) == [3, 2]
    assert allocate_round(gain=[math_nan(), 0.2], pad_to=5, **two) == [2, 3]  # NaN gain is served last
    assert allocate_round(gain=[0.5, 0.2], pad_to=2, **two) == [1, 1]  # already a multiple
    # prompt 0 at 15 of 16: one more fits, no padding for it; prompt 1 takes both padding samples
    assert allocate_round([True, True], [0.5, 0.2], [15, 4], min_active_frac=0.0, pad_to=4, **kw) == [1, 3]
    # no room anywhere for the padding: it is dropped
    assert allocate_round([True, True], [0.5, 0.2], [16, 15], min_active_frac=0.0, pad_to=4, **kw) == [0, 1]
    # round_size 3 but only 1 of room
    assert allocate_round([True], [0.5], [15], min_active_frac=0.0, pad_to=1, k_max=16, round_size=3) == [1]
    assert allocate_round([False, False], [0.5, 0.2], [4, 4], min_active_frac=0.0, pad_to=1, **kw) == [0, 0]


def math_nan() -> float:
    return float("nan")


def test_expected_mse_reduction_wants_a_first_sample_and_bounds_the_rest():
    """k = 0: +inf (no data yet). A missing prior at k = 3: σ²/3 − σ²/4 = 1/12. A prior that the data cannot reject
    (Δ̂² = 0): 0."""
    from lit_rlvr.functional.value_prior import expected_mse_reduction

    gain = expected_mse_reduction([0.0, 1.0, 0.5], [0.5, float("nan"), 0.5], [0, 3, 4], 1.0)
    assert gain[0] == float("inf") and abs(gain[1] - 1 / 12) < 1e-7 and gain[2] == 0.0
