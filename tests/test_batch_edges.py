"""Edges that scripts/mutation.py found unchecked (docs/mutation.md): each test kills named mutants."""

from __future__ import annotations

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts, Transcript, rollouts_from_completions
from lit_rlvr.rollout.engine import Completion

PAD = 0


def rows(lengths: list[int], source: int = 0, **fields) -> Rollouts:
    """One prompt of 2 tokens; response row i has lengths[i] tokens 1, 2, ... in a grid of max(lengths) columns."""
    n, width = len(lengths), max(lengths)
    mask = torch.arange(width) < torch.tensor(lengths)[:, None]  # [N, T]
    return Rollouts(prompt_ids=torch.full((n, 2), 7), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
                    response_ids=torch.where(mask, torch.arange(width) + 1, PAD), response_mask=mask,
                    old_logp=torch.where(mask, -0.5, 0.0), group=torch.zeros(n, dtype=torch.long),
                    source=torch.full((n,), source), num_groups=1, prompts=["p"], answers=["a"], **fields)


# -- Transcript, Rollouts ------------------------------------------------------------------------------------------
def test_transcript_defaults_to_no_turns_and_no_tool_calls():
    """A fresh transcript has run no tool, and has no error and no cut."""
    transcript = Transcript()
    assert transcript.tool_calls == 0 and transcript.turns == [] and transcript.error is None and transcript.cut is None
    assert transcript.to_dict() == {"turns": [], "tool_calls": 0, "error": None, "cut": None, "reward_error": None,
                                    "close_error": None}


def test_advantage_groups_of_no_completions_is_zero_groups():
    """With `adv_group` set but no completions (N = 0) there are no advantage groups: count 0."""
    empty = rows([1]).select(torch.zeros(0, dtype=torch.long))
    empty.adv_group = torch.zeros(0, dtype=torch.long)
    ids, count = empty.advantage_groups()
    assert ids.numel() == 0 and count == 0


def test_select_keeps_a_tensor_without_a_sample_dimension_as_it_is():
    """Only tensors with a leading N dimension are indexed; a 0-dim tensor is not per completion and is kept."""
    scalar = torch.tensor(0.25)
    picked = rows([1, 2, 3], rewards=scalar).select(torch.tensor([2, 0]))
    assert picked.rewards is scalar
    assert picked.response_ids.tolist() == [[1, 2, 3], [1, PAD, PAD]]


# -- concat ------------------------------------------------------------------------------------------------------
def test_concat_pads_the_attention_mask_with_false():
    """Joining rows of 1 and 3 response tokens: the narrower part's new columns are padding, False in
    `response_attention_mask` as in `response_mask`."""
    joined = Rollouts.concat([rows([1]), rows([3], source=1)], pad_id=PAD)
    assert joined.response_attention_mask.tolist() == [[True, False, False], [True, True, True]]
    assert joined.response_mask.tolist() == [[True, False, False], [True, True, True]]
    assert joined.response_ids.tolist() == [[1, PAD, PAD], [1, 2, 3]]
    assert joined.source.tolist() == [0, 1]


def test_concat_drops_an_optional_field_that_some_part_lacks():
    """rewards, malformed, loss_pass and adv_group are joined only when every part has them; else None."""
    scored = rows([1, 2], rewards=torch.tensor([1.0, 0.0]), malformed=torch.tensor([False, True]))
    unscored = rows([2])
    for parts in ([scored, unscored], [unscored, scored]):
        joined = Rollouts.concat(parts, pad_id=PAD)
        assert joined.rewards is None and joined.malformed is None
    both = Rollouts.concat([scored, rows([1], rewards=torch.tensor([0.5]), malformed=torch.tensor([False]))], PAD)
    assert both.rewards.tolist() == [1.0, 0.0, 0.5] and both.malformed.tolist() == [False, True, False]


# -- split_over_sources ------------------------------------------------------------------------------------------
def test_split_over_sources_rotation_balances_rounds():
    """3 sources; round 1 gives one sample (to source 0), round 2 two more with offset 1: they go to sources 1 and 2,
    so after both rounds each source has generated one (the remainder rotates forward from the offset)."""
    plan = RolloutPlan(["p"], ["a"], [[1]], [1], num_weight_sources=3)
    first = plan.split_over_sources([1])
    second = plan.split_over_sources([2], offset=[1])
    assert first == [[1], [0], [0]]
    assert second == [[0], [1], [1]]
    assert [a[0] + b[0] for a, b in zip(first, second)] == [1, 1, 1]


# -- rollouts_from_completions -----------------------------------------------------------------------------------
def _completion(tokens: list[int], mask: list[bool] | None) -> Completion:
    return Completion(token_ids=torch.tensor(tokens), logprobs=-0.1 * torch.ones(len(tokens)), finish_reason="stop",
                      token_mask=None if mask is None else torch.tensor(mask))


def test_observation_tokens_do_not_count_in_the_loss_mask():
    """Multi-turn completions (every one with a token_mask): an observation token (False) is in the sequence
    (`response_attention_mask`) but not in the loss (`response_mask`)."""
    plan = RolloutPlan(["p"], ["a"], [[5, 6]], [2])
    out = rollouts_from_completions(plan, [[_completion([3, 4, 5], [True, False, True]), _completion([8], [True])]],
                                    source=0, pad_id=PAD)
    assert out.response_mask.tolist() == [[True, False, True], [True, False, False]]
    assert out.response_attention_mask.tolist() == [[True, True, True], [True, False, False]]


def test_completions_without_a_token_mask_count_every_token_next_to_ones_with_one():
    """A token_mask of None means every token was sampled, also next to a completion that has a mask."""
    plan = RolloutPlan(["p"], ["a"], [[5, 6]], [2])
    out = rollouts_from_completions(plan, [[_completion([3, 4, 5], [True, False, True]), _completion([8, 9], None)]],
                                    source=0, pad_id=PAD)
    assert out.response_mask.tolist() == [[True, False, True], [True, True, False]]
    assert out.response_attention_mask.tolist() == [[True, True, True], [True, True, False]]
    assert out.response_ids.tolist() == [[3, 4, 5], [8, 9, PAD]]


# -- shaping -----------------------------------------------------------------------------------------------------
def test_overlong_cache_as_long_as_max_len_is_allowed():
    """cache_len = max_len is the top of the documented range [0, max_len]: L_max − L_cache = 0, so the penalty is
    −|y|/L_cache from the first token, −1 at L_max and beyond (Eq. 13)."""
    penalty, metrics = F.overlong_penalty(torch.tensor([0, 1, 2, 4, 5]), max_len=4, cache_len=4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -0.25, -0.5, -1.0, -1.0]))
    assert float(metrics["reward/overlong_frac"]) == pytest.approx(4 / 5)  # every non-empty response


def test_overlong_factor_scales_eq13_and_zero_is_allowed():
    """L_max = 8, L_cache = 3, factor 0.5: 0.5·(5 − |y|)/3 on (5, 8], −0.5 beyond; with no soft zone (cache_len 0) the
    penalty past L_max is −factor; factor 0 (the bottom of its range, >= 0) gives no penalty; a negative one raises."""
    penalty, _ = F.overlong_penalty(torch.tensor([5, 6, 7, 8, 9]), max_len=8, cache_len=3, factor=0.5)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -1 / 6, -1 / 3, -0.5, -0.5]))
    hard, _ = F.overlong_penalty(torch.tensor([8, 9]), max_len=8, cache_len=0, factor=2.0)
    assert hard.tolist() == [0.0, -2.0]
    off, metrics = F.overlong_penalty(torch.tensor([7, 9]), max_len=8, cache_len=3, factor=0.0)
    assert off.abs().tolist() == [0.0, 0.0] and float(metrics["reward/overlong_frac"]) == 0.0
    with pytest.raises(ValueError, match="factor"):
        F.overlong_penalty(torch.tensor([1]), max_len=8, cache_len=3, factor=-0.5)
