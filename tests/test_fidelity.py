"""The five decisions against verl's loss code (docs/fidelity.md), each against hand-worked numbers or an
independent oracle: the log-ratio clamp, groups of one, empty rows in sequence means, the "k3+" KL estimator
and DAPO's overlong penalty factor."""

from __future__ import annotations

from dataclasses import replace

import math
import os

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.config.options import consistency_problems, range_problems
from lit_rlvr.functional.value_prior import shrinkage_fusion
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from tiny_options import TINY as TINY_OPTIONS

TINY = {"cache_dir": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr"), **TINY_OPTIONS}  # = conf/model/tiny.yaml
ONE = torch.ones(1, 1, dtype=torch.bool)


# -- 1. the log-ratio is clamped to [−20, 20] before exp (verl) ----------------------------------------------------
def test_ppo_log_ratio_clamped_at_20_like_verl():
    """log r = 25 with A = −1: unclamped the surrogate is −e^25 (7.2e10); verl's clamp makes it −e^20 with no
    gradient. At log r = 19.5, inside the bound, value e^19.5 and gradient d(r)/dlogp = r: unchanged."""
    logp = torch.tensor([[25.0, 19.5]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = F.ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), mask, aggregation="token-mean")
    assert loss.item() == pytest.approx((math.exp(20) + math.exp(19.5)) / 2, rel=1e-6)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # past the bound: no gradient
    assert logp.grad[0, 1].item() == pytest.approx(math.exp(19.5) / 2, rel=1e-6)
    assert metrics["loss/approx_kl"].item() == pytest.approx((0.5 * 20**2 + 0.5 * 19.5**2) / 2)  # of the clamped


def test_ppo_log_ratio_clamp_keeps_fp32_finite_and_bounds_from_below():
    """log r = 100 overflows fp32's exp (inf past ~88.7): the clamp keeps loss and gradient finite. log r = −30
    with A = +1: r = e^−20 (clamped), the surrogate min(r, 0.8)·A = e^−20."""
    logp = torch.tensor([[100.0]], requires_grad=True)
    loss, _ = F.ppo_clip_loss(logp, torch.zeros(1, 1), torch.tensor([-2.0]), ONE)
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(2 * math.exp(20), rel=1e-6)
    loss.backward()
    assert logp.grad.item() == 0.0
    low, _ = F.ppo_clip_loss(torch.tensor([[-30.0]]), torch.zeros(1, 1), torch.tensor([1.0]), ONE)
    assert low.item() == pytest.approx(-math.exp(-20), rel=1e-5)


def test_gspo_sequence_log_ratio_capped_at_10_like_verl():
    """Two tokens with log-ratios 11 and 13: the sequence log-ratio 12 is capped at 10, so with A = −1 the loss
    is e^10 (not e^12) and no gradient flows; with 9 and 7 (mean 8) the value is e^8 and d/dlogp_t = e^8 / 2."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.tensor([[11.0, 13.0]], requires_grad=True)
    loss, _ = F.gspo_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(math.exp(10), rel=1e-6)
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0
    logp = torch.tensor([[9.0, 7.0]], requires_grad=True)
    loss, _ = F.gspo_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(math.exp(8), rel=1e-6)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([math.exp(8) / 2] * 2, rel=1e-6)


# -- 2. a group of one: advantage 0 around its own mean; r − b around a given baseline -------------------------------
def test_group_of_one_has_zero_advantage_around_its_mean():
    """verl gives a lone sample mean 0 and std 1 (A = r); here its group mean is itself, A = 0 (the limit of the
    group-mean estimator, (G−1)/G times the leave-one-out advantage), with or without the std division, and the
    group counts as zero-advantage."""
    rewards, group = torch.tensor([1.0, -1.0, 1.0]), torch.tensor([0, 0, 1])
    for scale in (True, False):
        adv, metrics = F.grpo_advantages(rewards, group, 2, scale_by_std=scale)
        assert adv[2].item() == 0.0
        assert metrics["groups/zero_adv_frac"].item() == 0.5
    adv, _ = F.grpo_advantages(rewards, group, 2, scale_by_std=True)
    assert adv[:2].tolist() == pytest.approx([1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6)])


def test_group_of_one_around_a_baseline_keeps_r_minus_b():
    """V0.5 (k = 1): the fused baseline b is a real baseline, so A = r − b; one sample has no spread to divide by,
    so std scaling leaves it unscaled (not (r − b)/eps)."""
    rewards, group = torch.tensor([1.0, -1.0]), torch.tensor([0, 1])
    for scale in (True, False):
        adv, metrics = F.grpo_advantages(rewards, group, 2, scale_by_std=scale, baseline=torch.tensor([0.25, -0.5]))
        assert adv.tolist() == [0.75, -0.5]
        assert metrics["groups/zero_adv_frac"].item() == 0.0


def test_v05_fusion_at_one_sample_gives_a_nonzero_advantage():
    """V0.5 with k_init = 1: prior V = 0.2, one reward −1: (v̄ − V)² = 1.44 > σ²/k = 1, so Δ̂² = 0.44,
    w = 0.44 / 1.44, b = 0.2 + w·(−1.2) = −0.16667; A = r − b = −0.83333 (a group of one still learns)."""
    baseline, _ = shrinkage_fusion([-1.0], [0.2], [1], 1.0)
    assert baseline[0] == pytest.approx(0.2 - 1.2 * 0.44 / 1.44, rel=1e-6)
    adv, _ = F.grpo_advantages(torch.tensor([-1.0]), torch.tensor([0]), 1, scale_by_std=False,
                               baseline=torch.tensor(baseline))
    assert adv.item() == pytest.approx(-1.0 - (0.2 - 1.2 * 0.44 / 1.44), rel=1e-6)


# -- 3. empty rows are left out of sequence means (verl's agg_loss) ------------------------------------------------
VALUES = torch.tensor([[1.0, 2.0], [7.0, 9.0], [4.0, 5.0]])
EMPTY_MIDDLE = torch.tensor([[True, True], [False, False], [True, False]])


@pytest.mark.parametrize("mode, expected", [
    ("seq-mean-token-mean", (1.5 + 4.0) / 2),  # not / 3
    ("seq-mean-token-sum", (3.0 + 4.0) / 2),
    ("seq-mean-token-sum-norm", (3.0 / 4 + 4.0 / 4) / 2),
    ("token-mean", 7.0 / 3),
])
def test_empty_rows_are_not_sequences(mode, expected):
    assert F.aggregate(VALUES, EMPTY_MIDDLE, mode, norm_len=4).item() == pytest.approx(expected)
    # the oracle: the same batch without the empty row
    without = F.aggregate(VALUES[[0, 2]], EMPTY_MIDDLE[[0, 2]], mode, norm_len=4)
    assert F.aggregate(VALUES, EMPTY_MIDDLE, mode, norm_len=4).item() == pytest.approx(without.item())


def test_a_batch_of_empty_rows_aggregates_to_zero():
    for mode in F.AGGREGATIONS:
        assert F.aggregate(VALUES, torch.zeros(3, 2, dtype=torch.bool), mode, norm_len=4).item() == 0.0


def test_gspo_and_the_sequence_mask_leave_empty_rows_out():
    """GSPO: an empty row (ratio 1) with A = 5 would add −5/3 to the loss; it is left out, so loss and clip
    fraction equal those of the batch without it. Seq-MIS: the drop fraction is over the two real sequences."""
    logp = torch.tensor([[0.1, 0.3], [0.0, 0.0], [2.0, 0.0]])
    adv = torch.tensor([1.0, 5.0, -1.0])
    loss, metrics = F.gspo_loss(logp, torch.zeros(3, 2), adv, EMPTY_MIDDLE, eps_low=0.5, eps_high=0.5)
    # seq 0: s = e^0.2 = 1.2214 (inside [0.5, 1.5]); seq 2: s = e^2 = 7.389, A = −1: min(−7.389, −1.5) = −7.389
    assert loss.item() == pytest.approx(-(math.exp(0.2) - math.exp(2.0)) / 2, rel=1e-6)
    assert metrics["loss/pg_clipfrac"].item() == 0.0
    keep, mask_metrics = F.sequence_importance_mask(logp, torch.zeros(3, 2), EMPTY_MIDDLE, tau=2.0)
    assert keep.tolist() == [True, True, False]  # Σ = 0.4 (kept), empty (ratio 1), 2.0 > ln 2 (dropped)
    assert mask_metrics["loss/seq_mask_frac"].item() == pytest.approx(1 / 2)
    _, none = F.sequence_importance_mask(logp, torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.bool))
    assert none["loss/seq_mask_frac"].item() == 0.0


def _batch(module: GRPOModule, lengths: list[int], width: int = 5) -> Rollouts:
    g = torch.Generator().manual_seed(1)
    n, p, t = len(lengths), 4, width
    return Rollouts(
        prompt_ids=torch.randint(4, 90, (n, p), generator=g), prompt_mask=torch.ones(n, p, dtype=torch.bool),
        response_ids=torch.randint(4, 90, (n, t), generator=g),
        response_mask=torch.arange(t) < torch.tensor(lengths)[:, None],
        old_logp=torch.full((n, t), -3.0), group=torch.zeros(n, dtype=torch.long),
        source=torch.zeros(n, dtype=torch.long), num_groups=1, prompts=["a"], answers=[0],
        advantages=torch.linspace(-1.0, 1.0, n))


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_module_gradient_with_an_empty_row_equals_the_batch_without_it(aggregation):
    """The module's micro-batch weights count sequences as `aggregate` does: with an empty row the gradient is
    that of the batch without it, at every micro-batch size (1 puts the empty row in a micro-batch of its own)."""
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=2, max_new_tokens=5,
                        loss_aggregation=aggregation)
    rollouts = _batch(module, [3, 0, 5, 2])
    oracle = rollouts.select(torch.tensor([0, 2, 3]))

    def grad(batch: Rollouts, size: int) -> torch.Tensor:
        module.algorithm = replace(module.algorithm, micro_batch_size=size)
        module.policy.zero_grad()
        module.make_update().backward_pass(batch, 0, {})  # no trainer: plain autograd
        return torch.cat([q.grad.flatten() for q in module.policy.parameters() if q.grad is not None])

    expected = grad(oracle, 4)
    for size in (4, 3, 1):
        torch.testing.assert_close(grad(rollouts, size), expected, rtol=1e-5, atol=1e-7)


# -- 4. "k3+": k3's value, k2's gradient (verl's straight-through) ----------------------------------------------------
def test_k3_plus_value_is_k3_and_gradient_is_k2s():
    """log r = ref − logp = −1 and 3: k3 = e^−1 = 0.3679 and e^3 − 4 = 16.0855. ∂k2/∂logp = logp − ref = 1, −3
    (k3's own: 1 − r = 0.632, −19.09). With the cap at 10 the value is capped, the gradient is still k2's."""
    ref = torch.tensor([[-2.0, -1.0]])
    for cap, second in ((None, math.exp(3) - 4), (10.0, 10.0)):
        logp = torch.tensor([[-1.0, -4.0]], requires_grad=True)
        value = F.kl_penalty(logp, ref, estimator="k3+", k3_cap=cap)
        assert value[0].tolist() == pytest.approx([math.exp(-1), second], rel=1e-6)
        assert torch.equal(value.detach(), F.kl_penalty(logp.detach(), ref, estimator="k3", k3_cap=cap))
        value.sum().backward()
        assert logp.grad[0].tolist() == pytest.approx([1.0, -3.0])
    logp = torch.tensor([[-1.0, -4.0]], requires_grad=True)
    F.kl_penalty(logp, ref, estimator="k3").sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([1 - math.exp(-1), 1 - math.exp(3)], rel=1e-6)


def test_k3_plus_gradient_is_not_cut_past_the_clamp():
    """log r = 25: the value is the clamped k3 = e^20 − 21; the gradient k2's, logp − ref = −25."""
    logp = torch.tensor([[-26.0]], requires_grad=True)
    value = F.kl_penalty(logp, torch.tensor([[-1.0]]), estimator="k3+")
    assert value.item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    value.backward()
    assert logp.grad.item() == pytest.approx(-25.0)


def test_k3_plus_expected_gradient_is_the_kl_gradient():
    """The oracle: on a categorical π_θ = softmax(θ) over 5 outcomes, the exact expectation over y ~ π_θ of
    ∇_θ k(y) (samples fixed: π(y) not differentiated) against autograd of the exact KL(π_θ ‖ π_ref). k3+ (k2's
    gradient) gives ∇KL; plain k3 gives the gradient of the reverse KL(π_ref ‖ π_θ) instead."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0, -0.4], dtype=torch.float64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.3, -1.0], dtype=torch.float64), 0)

    def expected_grad(estimator: str) -> torch.Tensor:
        logp = torch.log_softmax(theta, 0)
        per_outcome = F.kl_penalty(logp[None], ref_logp[None], estimator=estimator)[0]  # [5]
        (grad,) = torch.autograd.grad((logp.exp().detach() * per_outcome).sum(), theta)
        return grad

    def exact(forward: bool) -> torch.Tensor:
        logp = torch.log_softmax(theta, 0)
        kl = (logp.exp() * (logp - ref_logp)).sum() if forward else (ref_logp.exp() * (ref_logp - logp)).sum()
        (grad,) = torch.autograd.grad(kl, theta)
        return grad

    torch.testing.assert_close(expected_grad("k3+"), exact(forward=True))
    torch.testing.assert_close(expected_grad("k2"), exact(forward=True))
    torch.testing.assert_close(expected_grad("k3"), exact(forward=False))
    assert not torch.allclose(exact(forward=True), exact(forward=False))  # the two targets differ here


def test_k3_plus_is_a_valid_option_and_takes_the_cap():
    options = {"kl_estimator": "k3+", "kl_k3_cap": 10.0}
    assert range_problems(options, "algorithm") + consistency_problems(options) == []
    assert "algorithm.kl_k3_cap" in consistency_problems({"kl_estimator": "k2", "kl_k3_cap": 10.0})[0]
    with pytest.raises(ValueError, match="k3_cap"):
        F.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), estimator="k3+", k3_cap=0.0)


# -- 5. DAPO's overlong penalty factor (verl's overlong_buffer.penalty_factor) ----------------------------------------
def test_overlong_penalty_factor_scales_eq13():
    """max 8, cache 3 (penalty zone 6..8), factor 0.5: lengths 5, 6, 7, 8, 9 → 0, −1/6, −1/3, −1/2, −1/2 (at most
    −factor beyond max_len)."""
    penalty, metrics = F.overlong_penalty(torch.tensor([5, 6, 7, 8, 9]), max_len=8, cache_len=3, factor=0.5)
    assert penalty.tolist() == pytest.approx([0.0, -1 / 6, -1 / 3, -0.5, -0.5])
    assert metrics["reward/overlong_frac"].item() == pytest.approx(4 / 5)
    off, metrics = F.overlong_penalty(torch.tensor([7, 9]), max_len=8, cache_len=3, factor=0.0)
    assert off.tolist() == [0.0, 0.0] and metrics["reward/overlong_frac"].item() == 0.0
    hard, _ = F.overlong_penalty(torch.tensor([8, 9]), max_len=8, cache_len=0, factor=2.0)
    assert hard.tolist() == [0.0, -2.0]
    with pytest.raises(ValueError, match="factor"):
        F.overlong_penalty(torch.tensor([1]), max_len=8, cache_len=3, factor=-1.0)


def test_dapo_module_passes_the_factor_and_checks_it():
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=8, overlong_cache_len=3,
                        overlong_penalty_factor=0.5)
    # one group, rewards (1, 1, −1, −1), lengths (2, 7, 2, 8): penalties 0, −1/3, 0, −1/2 at factor 0.5
    rollouts = _batch(module, [2, 7, 2, 8], width=8)
    rollouts.rewards = torch.tensor([1.0, 1.0, -1.0, -1.0])
    adv, _ = module.compute_advantages(rollouts)
    shaped = torch.tensor([1.0, 1 - 1 / 3, -1.0, -1.5])
    assert adv.tolist() == pytest.approx(((shaped - shaped.mean()) / (shaped.std() + 1e-6)).tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="algorithm.overlong_penalty_factor"):
        GRPOModule(model="tiny", model_options=dict(TINY), max_new_tokens=8, overlong_penalty_factor=-0.5)
