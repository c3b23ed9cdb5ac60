"""The batch helpers of lit_rlvr/rollout/batch.py against hand-worked layouts: padding, trimming, selecting,
joining (group offsets when stacking), splitting counts over weight sources (the remainder's rotation) and packing
an engine's completions."""

from __future__ import annotations

import pytest
import torch

from lit_rlvr.rollout.batch import RolloutPlan, Rollouts, left_pad, rollouts_from_completions
from lit_rlvr.rollout.engine import Completion

PAD = 0


def make(lengths: list[int], prompt_lengths: list[int], group: list[int], num_groups: int, width: int = 5,
         prompt_width: int = 4, **fields) -> Rollouts:
    """Rows whose response token t of row i is 10·(i+1) + t (and old log-prob −(t+1)/10), prompts left-padded."""
    n = len(lengths)
    response_mask = torch.arange(width) < torch.tensor(lengths)[:, None]  # [N, T]
    response_ids = torch.where(response_mask, 10 * (torch.arange(n)[:, None] + 1) + torch.arange(width), PAD)
    prompt_mask = torch.arange(prompt_width - 1, -1, -1) < torch.tensor(prompt_lengths)[:, None]  # [N, P]
    return Rollouts(
        prompt_ids=torch.where(prompt_mask, 7, PAD), prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, old_logp=torch.where(response_mask, -(torch.arange(width) + 1) / 10, 0.0),
        group=torch.tensor(group), source=torch.zeros(n, dtype=torch.long), num_groups=num_groups,
        prompts=[f"p{b}" for b in range(num_groups)], answers=list(range(num_groups)),
        completions=[f"c{i}" for i in range(n)], finish_reason=["stop"] * n, **fields)


def test_left_pad_by_hand():
    ids, mask = left_pad([[1, 2], [3], []], pad_id=9)
    assert ids.tolist() == [[1, 2], [9, 3], [9, 9]]
    assert mask.tolist() == [[True, True], [False, True], [False, False]]
    ids, mask = left_pad([[], []], pad_id=9)
    assert ids.shape == (2, 0) and mask.shape == (2, 0)


def test_trim_padding_keeps_exactly_the_used_columns():
    """Prompts of 2 and 3 tokens in 4 columns: column 0 is unused, 3 stay. Responses of 3 and 1 tokens in 5
    columns: columns 3, 4 are unused, 3 stay (the longest row's), in ids, mask and old log-probs alike."""
    rollouts = make([3, 1], [2, 3], [0, 0], 1)
    trimmed = rollouts.trim_padding()
    assert trimmed.prompt_ids.shape == (2, 3) and trimmed.prompt_mask.tolist() == [[False, True, True]] + [[True] * 3]
    assert trimmed.response_ids.tolist() == [[10, 11, 12], [20, PAD, PAD]]
    assert trimmed.response_mask.tolist() == [[True, True, True], [True, False, False]]
    torch.testing.assert_close(trimmed.old_logp, torch.tensor([[-0.1, -0.2, -0.3], [-0.1, 0.0, 0.0]]))


def test_trim_padding_of_rows_without_tokens():
    """No response token anywhere: one response column stays (a forward needs one); no prompt token: none stays."""
    trimmed = make([0, 0], [0, 0], [0, 0], 1).trim_padding()
    assert trimmed.response_ids.shape == (2, 1) and trimmed.prompt_ids.shape == (2, 0)
    full = make([5, 2], [4, 1], [0, 0], 1).trim_padding()  # every column used: nothing cut
    assert full.response_ids.shape == (2, 5) and full.prompt_ids.shape == (2, 4)


def test_select_and_select_groups_renumber_and_cut_per_prompt_fields():
    rollouts = make([1, 2, 3, 4, 5], [1] * 5, [0, 0, 1, 2, 2], 3, rewards=torch.arange(5.0),
                    baseline=torch.tensor([0.5, 0.6, 0.7]))
    kept = rollouts.select_groups(torch.tensor([True, False, True]))
    assert kept.group.tolist() == [0, 0, 1, 1] and kept.num_groups == 2
    assert kept.rewards.tolist() == [0.0, 1.0, 3.0, 4.0] and kept.completions == ["c0", "c1", "c3", "c4"]
    assert kept.prompts == ["p0", "p2"] and kept.answers == [0, 2]
    assert kept.baseline.tolist() == pytest.approx([0.5, 0.7])
    picked = rollouts.select(torch.tensor([4, 1]))
    assert picked.group.tolist() == [2, 0] and picked.finish_reason == ["stop", "stop"]
    assert picked.baseline is rollouts.baseline  # per prompt: kept whole


def test_stack_groups_offsets_each_part_by_the_groups_before_it():
    """Parts of 2, 1 and 3 prompts: group ids shift by 0, 2 and 3; the prompts, answers and baselines follow."""
    parts = [make([1, 2], [1, 1], [0, 1], 2, baseline=torch.tensor([0.1, 0.2])),
             make([3], [2], [0], 1, width=3, baseline=torch.tensor([0.3])),
             make([1, 1, 1], [1, 1, 1], [2, 0, 1], 3, baseline=torch.tensor([0.4, 0.5, 0.6]))]
    stacked = Rollouts.stack_groups(parts, PAD)
    assert stacked.group.tolist() == [0, 1, 2, 5, 3, 4]
    assert stacked.num_groups == 6
    assert stacked.prompts == ["p0", "p1", "p0", "p0", "p1", "p2"]
    assert stacked.baseline.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    parts[1].baseline = None
    assert Rollouts.stack_groups(parts, PAD).baseline is None  # a part without baselines: none for the batch


def test_concat_pads_each_side_the_right_way():
    """Widths 2 and 4 (responses), 1 and 3 (prompts): responses right-padded with the pad id, mask False and
    old log-prob 0; prompts left-padded; per-sample optionals joined, or None when a part has none."""
    a = make([2], [1], [0], 1, width=2, prompt_width=1, rewards=torch.tensor([1.0]))
    b = make([4, 3], [3, 2], [0, 0], 1, width=4, prompt_width=3, rewards=torch.tensor([2.0, 3.0]))
    b.source = torch.tensor([1, 1])
    joined = Rollouts.concat([a, b], PAD)
    assert joined.response_ids.tolist()[0] == [10, 11, PAD, PAD]
    assert joined.response_mask.tolist()[0] == [True, True, False, False]
    assert joined.old_logp.tolist()[0] == pytest.approx([-0.1, -0.2, 0.0, 0.0])
    assert joined.prompt_ids.tolist()[0] == [PAD, PAD, 7] and joined.prompt_mask.tolist()[0] == [False, False, True]
    assert joined.rewards.tolist() == [1.0, 2.0, 3.0] and joined.source.tolist() == [0, 1, 1]
    assert joined.completions == ["c0", "c0", "c1"] and joined.malformed is None and joined.advantages is None
    assert Rollouts.concat([a], PAD) is a


def test_split_over_sources_rotates_the_remainder():
    """5 samples over 2 sources: 3 + 2, the extra one to source 0; a prompt that already has 1 sample starts at
    source 1, so the extra goes there (counts stay balanced over rounds). 4 over 3 sources from offset 2:
    sources 2, 0, 1, 2 → 1, 1, 2."""
    plan = RolloutPlan(prompts=["a", "b", "c"], answers=[0, 0, 0], prompt_token_ids=[[1], [2], [3]],
                       n_per_prompt=[5, 3, 0], num_weight_sources=2)
    assert plan.split_over_sources([5, 3, 0]) == [[3, 2, 0], [2, 1, 0]]
    assert plan.split_over_sources([5, 3, 0], offset=[1, 0, 0]) == [[2, 2, 0], [3, 1, 0]]
    plan.num_weight_sources = 3
    assert plan.split_over_sources([4], offset=[2]) == [[1], [1], [2]]
    assert plan.num_prompts == 3 and plan.uses_mean_weights
    plan.weight_context = lambda source: None
    assert not plan.uses_mean_weights


def test_group_sizes_tokens_and_advantage_groups():
    rollouts = make([2, 0, 3], [1, 1, 1], [1, 1, 0], 3)
    assert rollouts.group_sizes().tolist() == [1, 2, 0]
    assert rollouts.num_tokens() == 5 and rollouts.num_samples == 3
    assert rollouts.advantage_groups()[1] == 3
    rollouts.adv_group = torch.tensor([0, 4, 2])
    ids, count = rollouts.advantage_groups()
    assert ids.tolist() == [0, 4, 2] and count == 5
    rollouts.baseline = torch.zeros(3)
    with pytest.raises(ValueError, match="adv_group"):
        rollouts.advantage_groups()


def test_rollouts_from_completions_packs_rows_right_padded():
    """Prompt 0 gets completions of 2 and 0 tokens, prompt 1 one of 3: width 3, groups 0, 0, 1, the tokens and
    log-probs in place, the given source on every row."""
    plan = RolloutPlan(prompts=["a", "b"], answers=[1, 2], prompt_token_ids=[[5, 6], [7]], n_per_prompt=[2, 1])
    completions = [[Completion(torch.tensor([1, 2]), torch.tensor([-0.5, -0.25]), "stop"),
                    Completion(torch.tensor([], dtype=torch.long), torch.tensor([]), "length")],
                   [Completion(torch.tensor([3, 4, 5]), torch.tensor([-1.0, -2.0, -3.0]), "length")]]
    out = rollouts_from_completions(plan, completions, source=2, pad_id=PAD)
    assert out.group.tolist() == [0, 0, 1] and out.source.tolist() == [2, 2, 2]
    assert out.response_ids.tolist() == [[1, 2, PAD], [PAD, PAD, PAD], [3, 4, 5]]
    assert out.response_mask.sum(-1).tolist() == [2, 0, 3]
    assert out.old_logp.tolist() == [[-0.5, -0.25, 0.0], [0.0, 0.0, 0.0], [-1.0, -2.0, -3.0]]
    assert out.prompt_ids.tolist() == [[5, 6], [5, 6], [PAD, 7]]
    assert out.finish_reason == ["stop", "length", "length"] and out.num_groups == 2
    empty = rollouts_from_completions(plan, [[], []], source=0, pad_id=PAD)
    assert empty.response_ids.shape == (0, 1) and empty.num_samples == 0
