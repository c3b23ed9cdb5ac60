"""Edges of lit_rlvr/functional/ that the mutation run (scripts/mutation.py, docs/mutation.md) found unchecked,
each against a hand-worked number."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.functional.passk import pass_at_k
from lit_rlvr.functional.rollout_correction import (is_threshold_bounds, mismatch_metrics, rejection_mask,
                                                    rs_threshold_bounds, truncated_is_weights)


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


def test_dual_clip_leaves_positive_advantages_below_one_alone():
    """Dual-clip floors only A < 0: a token with 0 < A < 1 keeps its PPO term (c·A would be larger than it)."""
    logp = torch.tensor([[0.1, -0.3]], requires_grad=True)
    old, mask, adv = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.tensor([0.5])
    plain, _ = F.ppo_clip_loss(logp, old, adv, mask, aggregation="token-mean")
    dual, metrics = F.ppo_clip_loss(logp, old, adv, mask, aggregation="token-mean", dual_clip=3.0)
    assert dual.item() == plain.item()
    assert metrics["loss/pg_clipfrac_lower"].item() == 0.0


def test_dual_clip_at_exactly_c_keeps_the_gradient_as_verl():
    """ratio = c exactly, A < 0: the floor c·A equals the PPO term. Strictly below the floor only is a token
    floored (verl's `clip_pg_losses1 > pg_losses3`), so this one still gets its gradient and is not counted."""
    c = float(torch.exp(torch.tensor(0.7, dtype=torch.float64)))  # the same exp the loss computes
    logp = torch.tensor([[0.7]], dtype=torch.float64, requires_grad=True)
    old, mask = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    loss, metrics = F.ppo_clip_loss(logp, old, torch.tensor([-1.0]), mask, aggregation="token-mean", dual_clip=c)
    loss.backward()
    assert metrics["loss/pg_clipfrac_lower"].item() == 0.0
    assert logp.grad.item() == c  # d(−ratio·A)/d logp = ratio at A = −1


def test_gspo_approx_kl_off_the_unit_log_ratio():
    """k2 = ½(logp − old)² token mean: at log-ratios 0.5 and −1 it is (0.125 + 0.5) / 2."""
    logp = torch.tensor([[0.5, -1.0]])
    _, metrics = F.gspo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    assert metrics["loss/approx_kl"].item() == (0.125 + 0.5) / 2
    # one counted token of two: the mean is over that one
    _, metrics = F.gspo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[True, False]]))
    assert metrics["loss/approx_kl"].item() == 0.125


def test_sequence_importance_mask_default_tau_is_two():
    """3PO's default τ = 2: a summed log-ratio of 0.69 (ratio 1.99) is kept, 0.70 (2.01) dropped."""
    logp = torch.tensor([[0.69], [0.70], [-0.70]])
    keep, _ = F.sequence_importance_mask(logp, torch.zeros(3, 1), torch.ones(3, 1, dtype=torch.bool))
    assert keep.tolist() == [True, False, False]


def test_micro_batches_refuse_zero_rows_whatever_the_token_budget():
    with pytest.raises(ValueError, match="max_rows"):
        F.micro_batches(torch.tensor([3, 2]), max_rows=0)
    with pytest.raises(ValueError, match="max_tokens"):
        F.micro_batches(torch.tensor([3, 2]), max_rows=2, max_tokens=0)


def test_micro_batches_of_equal_lengths_keep_the_batch_order():
    """Ties are split in the order of the batch (a stable sort): the same rollouts form the same micro-batches on
    every run and rank, whatever the sort algorithm does with ties at this size."""
    lengths = torch.tensor([5, 7] * 40)  # 80 rows: large enough for torch's unstable sort to reorder ties
    micros, _ = F.micro_batches(lengths, max_rows=8, max_tokens=1000)
    assert torch.cat(micros).tolist() == list(range(1, 80, 2)) + list(range(0, 80, 2))


def test_micro_batches_of_an_empty_batch_have_no_padding():
    micros, metrics = F.micro_batches(torch.zeros(0, dtype=torch.long), max_rows=2, max_tokens=8)
    assert micros == [] and metrics["micro/padding_frac"].item() == 0.0


def test_pass_at_1_when_every_sample_is_correct():
    """c = n: pass@1 = 1 (the factor i = 1 of Π(1 − k/i) is 0), for n = 1 and n = 4."""
    value, _ = pass_at_k(torch.tensor([1, 4]), torch.tensor([1, 4]), 1)
    assert value.tolist() == [1.0, 1.0]


def test_is_threshold_below_one_is_a_valid_truncation():
    """verl's TIS truncates at any C > 0; C = 0.5 is a (strict) cap, not an error."""
    assert is_threshold_bounds(0.5) == (0.5, None)
    assert is_threshold_bounds("0.5_0.8") == (0.8, 0.5)


def test_dual_clip_accepts_any_bound_above_one():
    """c must only exceed 1 (verl's default is 3): c = 1.5 is valid and floors a token whose ratio ran past it."""
    logp, old = torch.tensor([[1.0]]), torch.zeros(1, 1)  # ratio e ≈ 2.72 > 1.5
    _, metrics = F.ppo_clip_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool), dual_clip=1.5)
    assert metrics["loss/pg_clipfrac_lower"].item() == 1.0


def test_dual_clip_floor_scales_with_the_advantage():
    """The floor is c·A: at A = −2, c = 3 a token whose ratio ran far past c has the term −6 (loss 6), and a masked
    token neither counts in the clip fraction nor spoils it."""
    logp, old = torch.tensor([[3.0, 3.0]]), torch.zeros(1, 2)  # ratio e³ ≈ 20 > 3
    mask = torch.tensor([[True, False]])
    loss, metrics = F.ppo_clip_loss(logp, old, torch.tensor([-2.0]), mask, aggregation="token-mean", dual_clip=3.0)
    assert loss.item() == 6.0
    assert metrics["loss/pg_clipfrac_lower"].item() == 1.0


def test_sequence_importance_mask_uses_the_log_ratio_to_old():
    """logp = old = 0.5 per token: ratio 1, kept; and with a single row present its fraction is 0 or 1."""
    logp, mask = torch.full((1, 1), 0.5), torch.ones(1, 1, dtype=torch.bool)
    keep, metrics = F.sequence_importance_mask(logp, torch.full((1, 1), 0.5), mask)
    assert keep.tolist() == [True] and metrics["loss/seq_mask_frac"].item() == 0.0
    keep, metrics = F.sequence_importance_mask(logp, torch.full((1, 1), -0.5), mask)  # log-ratio 1 > log 2
    assert keep.tolist() == [False] and metrics["loss/seq_mask_frac"].item() == 1.0


def test_micro_batches_take_a_budget_of_one_token():
    """max_tokens = 1 is valid: every row past the first goes alone (a row is never dropped for its length)."""
    micros, _ = F.micro_batches(torch.tensor([3, 2]), max_rows=4, max_tokens=1)
    assert [m.tolist() for m in micros] == [[0], [1]]


def test_is_threshold_bounds_edges():
    """A bool or a list is not a threshold; a lower bound must be > 0; lower = upper is a valid (narrow) band."""
    for bad in (True, [2.0]):
        with pytest.raises(ValueError, match="is not a number or a 'lower_upper' string"):
            is_threshold_bounds(bad)
    with pytest.raises(ValueError, match="bounds must be > 0"):
        is_threshold_bounds("0_2")
    assert is_threshold_bounds("1.5_1.5") == (1.5, 1.5)


def test_rollout_correction_defaults_are_verls_threshold_of_two():
    """verl's default threshold 2.0: a token ratio of 3 is truncated to 2 and rejected, 1.5 is neither."""
    log_ratio, mask = torch.log(torch.tensor([[3.0, 1.5]])), torch.ones(1, 2, dtype=torch.bool)
    weights, metrics = truncated_is_weights(log_ratio, mask)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.5]]))
    assert metrics["mismatch/is_clip_frac"].item() == 0.5
    keep, _ = rejection_mask(log_ratio, mask)
    assert keep.tolist() == [[False, True]]


def test_is_weights_at_exactly_the_bounds_are_kept_and_not_counted():
    """A weight equal to C (TIS) or to a or b (IcePop) is inside the band: unchanged, not in the clip fraction (verl
    counts ratio > upper and < lower). One counted token of two: the fraction is over that one."""
    log_ratio = torch.tensor([[0.5, 0.0]])
    at = float(torch.exp(log_ratio[0, 0]))  # the same float32 exp the function takes
    one = torch.tensor([[True, False]])
    for threshold in (at, f"{at!r}_{at + 1}", f"{at - 1!r}_{at!r}"):
        weights, metrics = truncated_is_weights(log_ratio, one, threshold=threshold)
        assert weights[0, 0].item() == at and metrics["mismatch/is_clip_frac"].item() == 0.0
    _, metrics = truncated_is_weights(log_ratio, one, threshold=1.2)
    assert metrics["mismatch/is_clip_frac"].item() == 1.0


def test_one_rejection_threshold_serves_every_option():
    """One spec for two options applies to both; a k2/k3 bound must be > 0."""
    assert rs_threshold_bounds("token_k1,token_k2", 2.0) == [("token_k1", 0.5, 2.0), ("token_k2", None, 2.0)]
    with pytest.raises(ValueError, match="must be > 0"):
        rs_threshold_bounds("token_k2", 0)


def test_rejection_keeps_a_statistic_at_exactly_its_bound():
    """verl keeps lower ≤ stat ≤ upper: k2 = ½·0.5² = 0.125 at the bound 0.125 passes, and k1 = ±1 at log-bounds ±1
    passes. One counted token of two, rejected: the masked fraction is over that one."""
    one = torch.tensor([[True, False]])
    keep, _ = rejection_mask(torch.tensor([[0.5, 0.0]]), one, modes="token_k2", threshold=0.125)
    assert keep.tolist() == [[True, False]]
    e = math.exp(1.0)
    for log_ratio in (1.0, -1.0):  # k1 = −log r = ∓1 against [log(1/e), log e]
        keep, _ = rejection_mask(torch.tensor([[log_ratio, 0.0]]), one, modes="token_k1", threshold=f"{1 / e!r}_{e!r}")
        assert keep.tolist() == [[True, False]]
    keep, metrics = rejection_mask(torch.tensor([[3.0, 0.0]]), one, modes="token_k1", threshold=2.0)
    assert keep.tolist() == [[False, False]] and metrics["mismatch/rs_masked_frac"].item() == 1.0


def test_mismatch_kl_of_one_counted_token():
    """k3 = r − 1 − log r of the one counted token (the padding's value does not enter the mean)."""
    kl, _ = mismatch_metrics(torch.tensor([[0.1, 5.0]]), torch.zeros(1, 2), torch.tensor([[True, False]]))
    assert kl.item() == pytest.approx(math.expm1(0.1) - 0.1, rel=1e-6)


def test_token_weights_scale_each_term_after_clipping():
    """The rollout correction's weights w scale each token's PPO term, s ← w·s; the normaliser is unchanged."""
    logp, old, mask = torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    loss, _ = F.ppo_clip_loss(logp, old, torch.tensor([1.0]), mask, aggregation="token-mean",
                              token_weights=torch.tensor([[0.5, 0.0]]))
    assert loss.item() == -0.25  # −(0.5·1 + 0·1) / 2
