"""Advantages, losses, KL estimators and aggregation against numbers worked out by hand."""

import math

import pytest
import torch

from lit_rlvr import functional as F


def test_grpo_advantages_by_hand():
    # group 0: rewards 1, -1, -1, 1 -> mean 0, unbiased std sqrt(4/3) = 1.1547
    # group 1: rewards 1, 1 -> mean 1, std 0 -> advantages 0 (a zero-advantage group)
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, metrics = F.grpo_advantages(rewards, group, 2)
    s = math.sqrt(4 / 3)
    expected = torch.tensor([1 / s, -1 / s, -1 / s, 1 / s, 0.0, 0.0])
    assert torch.allclose(adv, expected, atol=1e-5)
    assert metrics["groups/zero_adv_frac"].item() == pytest.approx(0.5)


def test_dr_grpo_and_given_baseline():
    rewards = torch.tensor([1.0, -1.0, -1.0])
    group = torch.tensor([0, 0, 0])
    adv, _ = F.grpo_advantages(rewards, group, 1, scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([4 / 3, -2 / 3, -2 / 3]))  # mean -1/3
    adv, _ = F.grpo_advantages(rewards, group, 1, scale_by_std=False, baseline=torch.tensor([0.5]))
    assert torch.allclose(adv, torch.tensor([0.5, -1.5, -1.5]))


def test_uneven_groups_mean_and_std():
    values = torch.tensor([2.0, 4.0, 1.0, 1.0, 4.0])
    group = torch.tensor([0, 0, 1, 1, 1])
    assert torch.allclose(F.group_mean(values, group, 3), torch.tensor([3.0, 2.0, 0.0]))
    # group 1: 1, 1, 4 -> mean 2, deviations -1, -1, 2 -> sum sq 6 / 2 = 3
    assert torch.allclose(F.group_std(values, group, 3), torch.tensor([math.sqrt(2), math.sqrt(3), 0.0]))


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert F.aggregate(values, mask, "token-mean").item() == pytest.approx(10 / 4)  # (1+2+3+4)/4
    assert F.aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert F.aggregate(values, mask, "seq-mean-token-sum-norm", norm_len=5).item() == pytest.approx((6 / 5 + 4 / 5) / 2)
    assert F.aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)  # verl's mode
    with pytest.raises(ValueError, match="token-mean"):
        F.aggregate(values, mask, "bogus")


def test_ppo_clip_loss_by_hand():
    # one sequence of 2 tokens, A = +1: ratios e^0.5 = 1.6487 (clipped to 1.2) and e^-0.5 = 0.6065 (min keeps it)
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-0.5, -0.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = F.ppo_clip_loss(logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.2)
    assert loss.item() == pytest.approx(-(1.2 + math.exp(-0.5)) / 2, rel=1e-5)
    assert metrics["loss/pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # the clipped token has no gradient; the other d(-ratio/2)/dlogp = -ratio/2
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-math.exp(-0.5) / 2, rel=1e-5)
    # A = -1: min(-r, -clip(r)) -> token 0: -1.6487 (unclipped, lower), token 1: -0.8 (clipped at 1 - 0.2)
    loss, _ = F.ppo_clip_loss(logp.detach(), old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx((math.exp(0.5) + 0.8) / 2, rel=1e-5)


def test_seq_mean_token_sum_gradient_by_hand():
    """Each token of a sequence gets weight 1 / N (N sequences), whatever the sequence's length (verl's
    seq-mean-token-sum): d/dv = mask / 2 here; a masked token gets none."""
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    F.aggregate(values, mask, "seq-mean-token-sum").backward()
    assert values.grad.tolist() == [[0.5, 0.5, 0.5], [0.5, 0.0, 0.0]]


def test_dual_clip_caps_negative_advantage_tokens_by_hand():
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729; verl's clip_ratio_c): for A < 0 the surrogate is at least
    c·A, so a token whose ratio ran past c stops pushing. Two tokens, A = −1, c = 3:
    token 0: r = e^1.5 = 4.4817 > 3: PPO gives −4.4817, dual-clip −3 (no gradient);
    token 1: r = e^0.5 = 1.6487 < 3: both give min(−1.6487, −1.2) = −1.6487."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.zeros(1, 2)
    logp = torch.tensor([[1.5, 0.5]], requires_grad=True)
    loss, metrics = F.ppo_clip_loss(logp, old, torch.tensor([-1.0]), mask, aggregation="token-mean", dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + math.exp(0.5)) / 2, rel=1e-6)
    assert metrics["loss/pg_clipfrac_lower"].item() == pytest.approx(0.5)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(math.exp(0.5) / 2, rel=1e-6)  # d(r/2)/dlogp = r/2
    # off (the default): the plain PPO value and no lower-clip metric
    plain, metrics = F.ppo_clip_loss(logp.detach(), old, torch.tensor([-1.0]), mask, aggregation="token-mean")
    assert plain.item() == pytest.approx((math.exp(1.5) + math.exp(0.5)) / 2, rel=1e-6)
    assert "loss/pg_clipfrac_lower" not in metrics
    # A > 0 is untouched: min(4.4817, 1.2) = 1.2 and min(1.6487, 1.2) = 1.2 either way
    pos, _ = F.ppo_clip_loss(logp.detach(), old, torch.tensor([1.0]), mask, aggregation="token-mean", dual_clip=3.0)
    assert pos.item() == pytest.approx(-1.2, rel=1e-6)


def test_dual_clip_bound_must_exceed_one():
    logp = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="dual_clip=1.0"):
        F.ppo_clip_loss(logp, logp, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool), dual_clip=1.0)


def test_clip_higher_is_asymmetric():
    logp, old = torch.tensor([[0.3]]), torch.tensor([[0.0]])  # ratio 1.3499
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = F.ppo_clip_loss(logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])  # log r = ref - logp = -1
    assert F.kl_penalty(logp, ref, estimator="k1").item() == pytest.approx(1.0)
    assert F.kl_penalty(logp, ref, estimator="k2").item() == pytest.approx(0.5)
    assert F.kl_penalty(logp, ref, estimator="k3").item() == pytest.approx(math.exp(-1) - 1 + 1)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        F.kl_penalty(logp, ref, estimator="k4")


def test_k3_cap_by_hand():
    """log r = ref − logp = 3: k3 = e^3 − 1 − 3 = 16.0855. verl caps k3 at 10 (`low_var_kl`); here the cap is an
    option, off by default."""
    logp, ref = torch.tensor([[-4.0, -1.0]], requires_grad=True), torch.tensor([[-1.0, -2.0]])
    uncapped = F.kl_penalty(logp, ref, estimator="k3")
    assert uncapped[0, 0].item() == pytest.approx(math.exp(3) - 4, rel=1e-6)
    capped = F.kl_penalty(logp, ref, estimator="k3", k3_cap=10.0)
    assert capped[0, 0].item() == pytest.approx(10.0)
    assert capped[0, 1].item() == pytest.approx(math.exp(-1), rel=1e-6)  # under the cap: unchanged
    capped.sum().backward()
    assert logp.grad[0, 0].item() == 0.0  # a capped token gives no gradient, as with verl's clamp
    with pytest.raises(ValueError, match="k3_cap"):
        F.kl_penalty(logp, ref, estimator="k1", k3_cap=10.0)


def test_sequence_importance_mask():
    mask = torch.ones(3, 2, dtype=torch.bool)
    old = torch.zeros(3, 2)
    logp = torch.tensor([[0.3, 0.3], [0.4, 0.4], [-0.3, -0.4]])  # Σ = 0.6 (keep), 0.8 (> ln 2: drop), -0.7 (drop)
    keep, metrics = F.sequence_importance_mask(logp, old, mask, tau=2.0)
    assert keep.tolist() == [True, False, False]
    assert metrics["loss/seq_mask_frac"].item() == pytest.approx(2 / 3)


def test_gspo_sequence_ratio():
    logp = torch.tensor([[0.1, 0.3]])
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # s = exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214; with A = 1 and a wide clip, loss = -s
    loss, _ = F.gspo_loss(logp, old, torch.tensor([1.0]), mask, eps_low=0.5, eps_high=0.5)
    assert loss.item() == pytest.approx(-math.exp(0.2), rel=1e-5)
    loss, _ = F.gspo_loss(logp, old, torch.tensor([1.0]), mask, eps_low=3e-4, eps_high=4e-4)
    assert loss.item() == pytest.approx(-(1 + 4e-4), rel=1e-6)


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probabilities 1/4, 3/4
    lp = F.token_logprobs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75))
    ent = F.entropy_from_logits(logits)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    # temperature 0.5 doubles the logits: p = 1/10, 9/10
    assert F.token_logprobs(logits, torch.tensor([[1]]), temperature=0.5).item() == pytest.approx(math.log(0.9))


def test_std_scaling_leaves_a_constant_group_around_a_baseline_alone():
    """V0.5 with scale_by_std: a group of equal rewards has A = r − b ≠ 0 and no spread; dividing by eps alone
    would give 5e5. Its advantages stay r − b, and it no longer counts as a zero-advantage group."""
    rewards, group = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0]), torch.tensor([0, 0, 0, 0, 1, 1])
    adv, metrics = F.grpo_advantages(rewards, group, 2, scale_by_std=True, baseline=torch.tensor([0.5, 0.0]))
    assert adv[:4].tolist() == [0.5] * 4
    assert adv[4:].tolist() == pytest.approx([1 / (2 ** 0.5 + 1e-6), -1 / (2 ** 0.5 + 1e-6)])  # std of (1, −1): √2
    assert metrics["groups/zero_adv_frac"].item() == 0.0
    adv, metrics = F.grpo_advantages(rewards, group, 2, scale_by_std=True)  # around the group mean
    assert adv[:4].tolist() == [0.0] * 4 and metrics["groups/zero_adv_frac"].item() == 0.5


# -- boundaries and edges (found by mutation testing: scripts/mutation.py) --------------------------------------------
def test_gspo_with_behaviour_logprobs_away_from_zero():
    """old = (−1.5, −1.7), logp = (−1, −2): log-ratios 0.5, −0.3, mean 0.1, s = e^0.1 = 1.10517. A = 2 with a
    wide clip: loss −2s, d/dlogp_t = −2s/2 = −s each; the paper's clip: min(2s, 2·1.0004) = 2.0008; A = −2:
    min(−2s, −2·1.0004) = −2s."""
    old, mask = torch.tensor([[-1.5, -1.7]]), torch.ones(1, 2, dtype=torch.bool)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    s = math.exp(0.1)
    loss, metrics = F.gspo_loss(logp, old, torch.tensor([2.0]), mask, eps_low=0.5, eps_high=0.5)
    assert loss.item() == pytest.approx(-2 * s, rel=1e-6) and metrics["loss/pg_clipfrac"].item() == 0.0
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-s, -s], rel=1e-6)
    loss, metrics = F.gspo_loss(logp.detach(), old, torch.tensor([2.0]), mask)
    assert loss.item() == pytest.approx(-2 * 1.0004, rel=1e-6) and metrics["loss/pg_clipfrac"].item() == 1.0
    loss, _ = F.gspo_loss(logp.detach(), old, torch.tensor([-2.0]), mask)
    assert loss.item() == pytest.approx(2 * s, rel=1e-6)
    # below the band: s = e^−0.1 = 0.9048 < 1 − 3e-4; A = +1 takes the lower value s, A = −1 the clipped −0.9997
    low = torch.tensor([[-1.6, -1.8]])
    assert F.gspo_loss(low, old, torch.tensor([1.0]), mask)[0].item() == pytest.approx(-math.exp(-0.1), rel=1e-6)
    loss, metrics = F.gspo_loss(low, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(1 - 3e-4, rel=1e-6) and metrics["loss/pg_clipfrac"].item() == 1.0
    # approx_kl: ½ mean of the token log-ratios squared = ½ (0.01 + 0.01) / 2
    assert metrics["loss/approx_kl"].item() == pytest.approx(0.5 * (0.01 + 0.01) / 2, rel=1e-5)


def test_k1_k2_k3_away_from_log_r_one():
    """log r = ref − logp = 3 and −0.5: k1 = −3, 0.5; k2 = 4.5, 0.125; k3 = e^3 − 4, e^−0.5 − 0.5;
    ∂k2/∂logp = logp − ref = −3, 0.5; ∂k1/∂logp = 1."""
    ref = torch.tensor([[-1.0, -2.5]])
    k3 = ([math.exp(3) - 4, math.exp(-0.5) - 0.5], [1 - math.exp(3), 1 - math.exp(-0.5)])
    for estimator, value, grad in (("k1", [-3.0, 0.5], [1.0, 1.0]), ("k2", [4.5, 0.125], [-3.0, 0.5]), ("k3", *k3)):
        logp = torch.tensor([[-4.0, -2.0]], requires_grad=True)
        kl = F.kl_penalty(logp, ref, estimator=estimator)
        assert kl[0].tolist() == pytest.approx(value, rel=1e-6)
        kl.sum().backward()
        assert logp.grad[0].tolist() == pytest.approx(grad, rel=1e-6)


def test_k3_clamp_from_below_and_a_cap_under_one():
    """log r = −25 is clamped to −20: k3 = e^−20 − 1 + 20 = 19.000000002 (unclamped it would be 24); a cap of 0.5
    (any cap > 0 is valid) caps k3 = e^1 − 2 = 0.718 at 0.5 and leaves e^−1 = 0.368 alone."""
    low = F.kl_penalty(torch.tensor([[0.0]]), torch.tensor([[-25.0]]), estimator="k3")
    assert low.item() == pytest.approx(19.0 + math.exp(-20), rel=1e-7)
    capped = F.kl_penalty(torch.tensor([[-2.0, -1.0]]), torch.tensor([[-1.0, -2.0]]), estimator="k3", k3_cap=0.5)
    assert capped[0].tolist() == pytest.approx([0.5, math.exp(-1)], rel=1e-6)


def test_sequence_mask_keeps_a_ratio_of_exactly_tau():
    """|Σ log-ratio| = log τ exactly (as float32) is kept, at both ends; one float32 step beyond is dropped."""
    bound = torch.log(torch.tensor(2.0))  # float32 log 2
    beyond = torch.nextafter(bound, torch.tensor(1.0))
    logp = torch.stack([bound, -bound, beyond, -beyond])[:, None]  # [4, 1]
    keep, metrics = F.sequence_importance_mask(logp, torch.zeros(4, 1), torch.ones(4, 1, dtype=torch.bool), tau=2.0)
    assert keep.tolist() == [True, True, False, False]
    assert metrics["loss/seq_mask_frac"].item() == 0.5
    # only counted tokens enter the sum: a masked log-ratio of 5 changes nothing
    keep, _ = F.sequence_importance_mask(torch.tensor([[0.1, 5.0]]), torch.zeros(1, 2), torch.tensor([[True, False]]))
    assert keep.tolist() == [True]


def test_ppo_metrics_count_only_masked_tokens():
    """approx_kl = mean over counted tokens of ½(logp − old)²: tokens 0.3 and −0.5 (the third is masked out):
    (0.045 + 0.125)/2 = 0.085; pg_clipfrac: token 0.3 with A = 1 (r = 1.35 > 1.2) is clipped, −0.5 not: 1/2.
    No counted token: both metrics 0."""
    logp = torch.tensor([[0.3, -0.5, 4.0]])
    mask = torch.tensor([[True, True, False]])
    _, metrics = F.ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask)
    assert metrics["loss/approx_kl"].item() == pytest.approx(0.085, rel=1e-6)
    assert metrics["loss/pg_clipfrac"].item() == pytest.approx(0.5)
    loss, metrics = F.ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.zeros(1, 3, dtype=torch.bool))
    assert (loss.item(), metrics["loss/approx_kl"].item(), metrics["loss/pg_clipfrac"].item()) == (0.0, 0.0, 0.0)


def test_ppo_clip_at_exactly_the_clip_bound_is_not_counted_clipped():
    """r = 1 with ε_high = 0: clip(r) = r = 1, so nothing is clipped (the count uses a strict <); the loss is −1."""
    loss, metrics = F.ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([1.0]),
                                    torch.ones(1, 1, dtype=torch.bool), eps_high=0.0)
    assert metrics["loss/pg_clipfrac"].item() == 0.0 and loss.item() == -1.0


def test_zero_adv_frac_at_the_edges():
    """Only groups with completions count: 4 groups, group 3 empty; group 0 constant (zero advantage), group 1 a
    tiny spread (1e-3: its advantages are ±0.707, not zero), group 2 of one (zero): 2/3. No completions at all:
    0, not NaN. The std eps shows on a spread of 2e-6: A = ±1e-6/(1.414e-6 + 1e-6) = ±0.414."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 1e-3, 0.5])
    group = torch.tensor([0, 0, 1, 1, 2])
    adv, metrics = F.grpo_advantages(rewards, group, 4)
    assert metrics["groups/zero_adv_frac"].item() == pytest.approx(2 / 3)
    half_gap = 0.5e-3 / (math.sqrt(0.5e-6) + 1e-6)  # (r − mean) / (std + eps), std = 1e-3/√2
    assert adv[2:4].tolist() == pytest.approx([-half_gap, half_gap], rel=1e-4)
    _, metrics = F.grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), 2)
    assert metrics["groups/zero_adv_frac"].item() == 0.0
    adv, _ = F.grpo_advantages(torch.tensor([0.0, 2e-6], dtype=torch.float64), torch.tensor([0, 0]), 1)
    spread = math.sqrt(2) * 1e-6
    assert adv.tolist() == pytest.approx([-1e-6 / (spread + 1e-6), 1e-6 / (spread + 1e-6)], rel=1e-6)
    adv, _ = F.grpo_advantages(torch.tensor([0.0, 2e-6], dtype=torch.float64), torch.tensor([0, 0]), 1, eps=0.0)
    assert adv.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-6)


def test_group_helpers_with_empty_groups():
    """Group 1 has no completions: mean 0, std 0, not constant; a group of one: std 0 (not NaN as torch.std)."""
    values, group = torch.tensor([2.0, 4.0, 3.0]), torch.tensor([0, 0, 2])
    assert F.group_mean(values, group, 3).tolist() == [3.0, 0.0, 3.0]
    assert F.group_std(values, group, 3).tolist() == pytest.approx([math.sqrt(2), 0.0, 0.0])
    assert F.constant_groups(values, group, 3).tolist() == [False, False, True]
