"""V0.5 math: shrinkage fusion (Eq. 8), OSLA rule (Eq. 12), round allocation — hand-worked and properties."""

import math

import pytest
import torch

from lit_rlvr.functional import value_prior as lib  # what the callback runs, in plain Python
from lit_rlvr.functional.value_prior import baseline_mse, reward_noise_var
from tests.v05_tensor_oracles import allocate_round, expected_mse_reduction, osla_wants_more, shrinkage_fusion


def t(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# ----------------------------------------------------------------------------------------------- fusion


def test_fusion_hand_worked():
    # k = 4, σ² = 1 → σ²/k = 0.25
    # a) v̄ = 0.5, V = -0.5: (v̄-V)² = 1.0, Δ̂² = 0.75, w = 0.75/1.0 = 0.75, b = 0.75·0.5 + 0.25·(-0.5) = 0.25
    # b) v̄ = 0.5, V = 0.2:  (0.3)² = 0.09 ≤ 0.25 → Δ̂² = 0, w = 0, b = V = 0.2
    # c) v̄ = 1.0, V = -1.0: 4 - 0.25 = 3.75, w = 3.75/4 = 0.9375, b = 0.9375 - 0.0625 = 0.875
    # d) v̄ = 0.75, V = 0.25: (0.5)² = 0.25, exactly σ²/k → Δ̂² = 0, b = V (boundary is "not rejected")
    b, m = shrinkage_fusion(t(0.5, 0.5, 1.0, 0.75), t(-0.5, 0.2, -1.0, 0.25), t(4, 4, 4, 4, dtype=torch.long))
    torch.testing.assert_close(b, t(0.25, 0.2, 0.875, 0.25))
    torch.testing.assert_close(m["w"], t(0.75, 0.0, 0.9375, 0.0))
    torch.testing.assert_close(m["bias_sq"], t(0.75, 0.0, 3.75, 0.0))
    assert m["prior_rejected"].tolist() == [True, False, True, False]
    assert not m["prior_missing"].any()


def test_fusion_other_noise_var_and_edge_cases():
    # rewards in [0, 1]: σ² = (1-0)²/4 = 0.25, σ²/k = 0.0625
    # v̄ = 0.75, V = 0.25: 0.25 - 0.0625 = 0.1875, w = 0.1875/0.25 = 0.75, b = 0.25 + 0.75·0.5 = 0.625
    assert reward_noise_var(0.0, 1.0) == 0.25 and reward_noise_var() == 1.0
    b, m = shrinkage_fusion(t(0.75), t(0.25), t(4), noise_var=reward_noise_var(0.0, 1.0))
    torch.testing.assert_close(b, t(0.625))
    torch.testing.assert_close(m["w"], t(0.75))
    # missing prior (NaN) → plain mean, w = 1; no samples → the prior, w = 0
    b, m = shrinkage_fusion(t(0.3, float("nan")), t(float("nan"), 0.1), t(4, 0))
    torch.testing.assert_close(b, t(0.3, 0.1))
    torch.testing.assert_close(m["w"], t(1.0, 0.0))
    assert m["prior_missing"].tolist() == [True, False]
    assert m["prior_rejected"].tolist() == [False, False]
    with pytest.raises(ValueError, match="high > low"):
        reward_noise_var(1.0, 1.0)


def test_fusion_metrics_are_detached():
    mean = t(0.5, -0.5).requires_grad_()
    b, m = shrinkage_fusion(mean, t(0.0, 0.9), t(4, 4))
    assert b.requires_grad and all(not v.requires_grad for v in m.values())


@pytest.mark.parametrize("seed", range(5))
def test_fusion_properties_random(seed):
    g = torch.Generator().manual_seed(seed)
    n = 4000
    k = torch.randint(1, 17, (n,), generator=g)  # [n]
    noise_var = [1.0, 0.25, 2.0][seed % 3]
    # sample means on the ±1 grid they can take after k rollouts, priors anywhere in [-1, 1]
    mean = (torch.binomial(k.float(), torch.rand(n, generator=g), generator=g) / k) * 2 - 1  # [n]
    prior = torch.rand(n, generator=g) * 2 - 1  # [n]
    b, m = shrinkage_fusion(mean, prior, k, noise_var=noise_var)
    w = m["w"]
    assert ((w >= 0) & (w < 1)).all()
    not_rejected = (mean - prior).square() <= noise_var / k  # [n]
    assert not_rejected.any() and (~not_rejected).any()
    assert torch.equal(b[not_rejected], prior[not_rejected])  # exactly V
    assert torch.equal(~m["prior_rejected"], not_rejected)
    bound = math.sqrt(noise_var) / k.float().sqrt()  # [n] σ/√k
    assert ((b - mean).abs() <= bound + 1e-6).all()
    lo, hi = torch.minimum(mean, prior), torch.maximum(mean, prior)
    assert ((b >= lo - 1e-6) & (b <= hi + 1e-6)).all()  # convex combination


@pytest.mark.parametrize("bad_frac, max_ratio", [(0.0, 0.5), (0.2, 1.2)])
def test_fusion_beats_small_group_mean_in_simulation(bad_frac, max_ratio):
    """Known success probabilities, k = 4: fused MSE vs the 4-sample mean's MSE against the true mean."""
    g = torch.Generator().manual_seed(1234)
    n, k = 20000, 4
    p = torch.rand(n, generator=g)  # [n] true success probability
    true_mean = 2 * p - 1  # [n] on the ±1 scale
    prior = (true_mean + 0.1 * torch.randn(n, generator=g)).clamp(-1, 1)  # [n] close prior, error sd 0.1
    wrong = torch.rand(n, generator=g) < bad_frac  # [n]
    prior = torch.where(wrong, -true_mean, prior)  # badly wrong: the opposite of the truth
    rewards = (torch.rand(n, k, generator=g) < p[:, None]).float() * 2 - 1  # [n, k]
    mean = rewards.mean(1)  # [n]
    b, _ = shrinkage_fusion(mean, prior, torch.full((n,), k))
    mse_fused = (b - true_mean).square().mean()
    mse_mean = (mean - true_mean).square().mean()
    assert mse_fused <= max_ratio * mse_mean, (mse_fused, mse_mean)


# ----------------------------------------------------------------------------------------------- OSLA


def test_osla_hand_worked():
    # MSE(k) = σ²Δ̂²/(kΔ̂² + σ²), σ² = 1
    # a) Δ̂² = 0.75 at k = 4: MSE(4) = 0.75/4 = 0.1875, MSE(5) = 0.75/4.75 = 0.157895, gain 0.029605 > c
    # b) Δ̂² = 0 (prior not rejected): MSE = 0 for every k, gain 0 → stop
    # c) v̄ = 1, V = -1 at k = 15: Δ̂² = 4 - 1/15 = 3.93333, MSE(15) = 3.93333/60 = 0.0655556,
    #    MSE(16) = 3.93333/63.93333 = 0.0615224, gain 0.0040331 > 0.0039 → more
    # d) same at k = 16: Δ̂² = 4 - 1/16 = 3.9375, MSE(16) = 3.9375/64 = 0.0615234,
    #    MSE(17) = 3.9375/67.9375 = 0.0579577, gain 0.0035658 < 0.0039 → stop (16 is the natural cap)
    mean, prior = t(0.5, 0.5, 1.0, 1.0), t(-0.5, 0.2, -1.0, -1.0)
    counts = t(4, 4, 15, 16, dtype=torch.long)
    torch.testing.assert_close(baseline_mse(mean, prior, counts), t(0.1875, 0.0, 0.0655556, 0.0615234))
    gain = expected_mse_reduction(mean, prior, counts)
    torch.testing.assert_close(gain, t(0.0296053, 0.0, 0.0040331, 0.0035658), atol=1e-6, rtol=1e-4)
    assert osla_wants_more(mean, prior, counts, k_max=32).tolist() == [True, False, True, False]
    # k_max caps even when the gain is worth it
    assert osla_wants_more(mean, prior, counts, k_max=15).tolist() == [True, False, False, False]
    # no prior: gain is the plain mean's σ²/k - σ²/(k+1) = 1/4 - 1/5 = 0.05; no data: always want one
    gain = expected_mse_reduction(t(0.0, 0.0), t(float("nan"), 0.3), t(4, 0))
    torch.testing.assert_close(gain[:1], t(0.05))
    assert math.isinf(gain[1])


def test_osla_far_prior_stops_at_16_with_default_cost():
    # a hopeless prior: Δ̂² large, gain ≈ 1/(k(k+1)) → asks up to k = 15, the 16th sample is the last
    counts = torch.arange(1, 20)  # [19]
    wants = osla_wants_more(torch.ones(19), -torch.ones(19) * 1e3, counts, k_max=100)
    assert wants[counts < 16].all() and not wants[counts >= 16].any()


# ----------------------------------------------------------------------------------------------- allocation


def test_allocate_round_hand_worked():
    wants = t(1, 1, 1, 0, 0, 0, 0, 0, dtype=torch.bool)  # 3 of 8 active = 37.5% ≥ 25%
    gain = t(0.5, 0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0)
    counts = torch.full((8,), 4)
    # 3 sequences, pad to 4: one padding sample to the largest gain (prompt 0)
    assert allocate_round(wants, gain, counts, k_max=16, pad_to=4).tolist() == [2, 1, 1, 0, 0, 0, 0, 0]
    # pad to 8: 5 padding samples, one each to the 5 largest gains
    assert allocate_round(wants, gain, counts, k_max=16, pad_to=8).tolist() == [2, 2, 2, 1, 1, 0, 0, 0]
    # pad to 16: 13 padding over 8 prompts → two passes (8 + 5)
    assert allocate_round(wants, gain, counts, k_max=16, pad_to=16).tolist() == [3, 3, 3, 2, 2, 1, 1, 1]
    # round_size 2, no padding
    assert allocate_round(wants, gain, counts, k_max=16, pad_to=1, round_size=2).tolist() == [2, 2, 2] + [0] * 5
    # 1 of 8 active = 12.5% < 25% → the round stops
    one = t(1, 0, 0, 0, 0, 0, 0, 0, dtype=torch.bool)
    assert allocate_round(one, gain, counts, k_max=16).tolist() == [0] * 8
    assert allocate_round(one, gain, counts, k_max=16, min_active_frac=0.1, pad_to=1).tolist() == [1] + [0] * 7
    # k_max binds: prompts 0-2 are at 15 (room 1), prompt 3-7 at 16 (full): padding has nowhere to go
    full = t(15, 15, 15, 16, 16, 16, 16, 16, dtype=torch.long)
    placed = allocate_round(wants, gain, full, k_max=16, pad_to=32, min_active_frac=0.0)
    assert placed.tolist() == [1, 1, 1] + [0] * 5
    with pytest.raises(ValueError, match="pad_to"):
        allocate_round(wants, gain, counts, k_max=16, pad_to=0)


@pytest.mark.parametrize("seed", range(20))
def test_allocate_round_properties_random(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 80, (1,), generator=g))
    k_max = int(torch.randint(4, 20, (1,), generator=g))
    pad_to = int(torch.randint(1, 40, (1,), generator=g))
    round_size = int(torch.randint(1, 4, (1,), generator=g))
    frac = float(torch.rand(1, generator=g)) * 0.6
    counts = torch.randint(0, k_max + 1, (n,), generator=g)  # [n]
    wants = torch.rand(n, generator=g) < 0.5  # [n]
    gain = torch.rand(n, generator=g)  # [n]
    extra = allocate_round(
        wants, gain, counts, k_max=k_max, min_active_frac=frac, pad_to=pad_to, round_size=round_size
    )
    assert extra.dtype == torch.long and extra.shape == (n,) and (extra >= 0).all()
    assert (counts + extra <= k_max).all()  # never past k_max
    active = wants & (counts < k_max)
    if active.sum() < frac * n or not active.any():
        assert extra.sum() == 0
        return
    assert (extra[active] >= 1).all()  # every active prompt gets at least one
    room_total = (k_max - counts).clamp_min(0).sum()
    assert extra.sum() % pad_to == 0 or extra.sum() == room_total  # padded, or every slot is used
    # padding follows the gain: a prompt given padding has gain ≥ any prompt with room that got none
    padded = extra > torch.where(active, (k_max - counts).clamp_max(round_size), 0)
    starved = (extra == 0) & (counts < k_max)
    if padded.any() and starved.any():
        assert gain[padded].min() >= gain[starved].max()


@pytest.mark.parametrize("seed", range(3))
def test_rounds_spend_samples_where_the_prior_is_wrong(seed):
    """Simulated V0.5 rounds: start at k = 4, ask OSLA, allocate, sample, repeat until the round is empty."""
    g = torch.Generator().manual_seed(seed)
    n, k_init, k_max = 128, 4, 16
    p = torch.rand(n, generator=g)  # [n]
    true_mean = 2 * p - 1  # [n]
    wrong = torch.arange(n) % 2 == 0  # [n] half the priors are the opposite of the truth
    prior = torch.where(wrong, -true_mean, (true_mean + 0.1 * torch.randn(n, generator=g)).clamp(-1, 1))
    counts = torch.full((n,), k_init)  # [n]
    sums = (torch.binomial(counts.float(), p, generator=g) * 2 - counts).float()  # [n] sum of ±1 rewards
    for _ in range(k_max):
        mean = sums / counts  # [n]
        wants = osla_wants_more(mean, prior, counts, k_max=k_max)
        gain = expected_mse_reduction(mean, prior, counts)
        extra = allocate_round(wants, gain, counts, k_max=k_max, pad_to=8)
        if extra.sum() == 0:
            break
        sums = sums + torch.binomial(extra.float(), p, generator=g) * 2 - extra
        counts = counts + extra
    assert (counts <= k_max).all()
    assert counts[wrong].float().mean() > 1.5 * counts[~wrong].float().mean()
    # prompts whose flipped prior is near the truth (p ≈ 0.5) cannot be told apart; the far ones must be
    far = wrong & ((2 * p - 1).abs() > 0.6)
    assert counts[far].float().mean() > counts[~wrong].float().mean() + 2


def test_library_functions_give_the_tensor_oracles_bits():
    """The library's plain-Python functions (what the callback runs) compute what the tensor oracles tested above
    compute, bit for bit (the AUC metric to float32 rounding): random and grid means, priors with NaNs and
    priors equal to a mean, counts with zeros, several noise variances, costs and batch rules."""
    import numpy as np

    from lit_rlvr.functional.ranking import binary_auroc, binary_auroc_py

    g = torch.Generator().manual_seed(0)
    for case in range(300):
        n = int(torch.randint(1, 40, (1,), generator=g))
        counts = torch.randint(0, 17, (n,), generator=g)  # [n]
        mean = (torch.rand(n, generator=g) * 2 - 1).float()  # [n]
        if case % 2:  # rewards of ±1 with k samples: means on a grid, as in training
            mean = (2 * torch.randint(0, 17, (n,), generator=g) / counts.clamp_min(1) - 1).clamp(-1, 1).float()
        prior = (torch.rand(n, generator=g) * 2 - 1).float()  # [n]
        prior[torch.rand(n, generator=g) < 0.2] = float("nan")
        same = torch.rand(n, generator=g) < 0.1
        prior[same] = mean[same]  # prior = mean: no excess, bias 0, ratio inf
        noise_var = [1.0, 0.25, 2.0][case % 3]
        b, m = shrinkage_fusion(mean, prior, counts, noise_var=noise_var)
        b_py, m_py = lib.shrinkage_fusion(mean.tolist(), prior.tolist(), counts.tolist(), noise_var)
        assert np.array_equal(b.numpy(), np.array(b_py, dtype=np.float32), equal_nan=True)
        for key in m:
            assert np.array_equal(m[key].numpy(), np.array(m_py[key], dtype=m[key].numpy().dtype), equal_nan=True), key
        assert all(float(np.float32(v)) == v or v != v for v in b_py + m_py["w"] + m_py["bias_sq"])  # float32 values
        gain = expected_mse_reduction(mean, prior, counts, noise_var=noise_var)
        gain_py = lib.expected_mse_reduction(mean.tolist(), prior.tolist(), counts.tolist(), noise_var)
        assert np.array_equal(gain.numpy(), np.array(gain_py, dtype=np.float32), equal_nan=True)
        assert all(float(np.float32(v)) == v or v != v for v in gain_py)  # float32 values
        k_max, cost = [16, 8, 32][case % 3], [0.0039, 0.01, 0.0][case % 3]
        wants = osla_wants_more(mean, prior, counts, noise_var=noise_var, cost=cost, k_max=k_max)
        rules = dict(k_max=k_max, min_active_frac=[0.25, 0.0, 0.5][case % 3], pad_to=[32, 1, 8][case % 3],
                     round_size=[1, 2][case % 2])
        extra = allocate_round(wants, gain, counts, **rules)
        wants_py = lib.osla_wants_more(gain_py, counts.tolist(), cost=float(torch.tensor(cost)), k_max=k_max)
        assert wants_py == wants.tolist()
        assert extra.tolist() == lib.allocate_round(wants_py, gain_py, counts.tolist(), **rules)
        labels = torch.rand(n, generator=g) < 0.5
        auc, auc_py = float(binary_auroc(mean, labels)), binary_auroc_py(mean.tolist(), labels.tolist())
        # the torch function rounds to float32; the Python one keeps float64
        assert auc == pytest.approx(auc_py, rel=1e-6, nan_ok=True), (auc, auc_py)
    # a squared gap that overflows float32: Δ̂² = inf, so torch's w is 1; the Python twin's too
    mean, prior, counts = torch.tensor([3e38, 0.5]), torch.tensor([-3e38, 0.1]), torch.tensor([4, 4])
    b, m = shrinkage_fusion(mean, prior, counts, noise_var=1.0)
    b_py, m_py = lib.shrinkage_fusion(mean.tolist(), prior.tolist(), counts.tolist(), 1.0)
    assert b_py == b.tolist() and m_py["w"] == m["w"].tolist() == [1.0, 0.0]


def test_group_mean_py_matches_group_mean_on_pm1_rewards():
    """The callback's per-prompt means and counts equal `group_mean` and `bincount` (±1 sums are exact)."""
    from lit_rlvr.functional.advantages import group_mean
    from lit_rlvr.functional.value_prior import group_mean_py

    g = torch.Generator().manual_seed(1)
    group = torch.randint(0, 7, (50,), generator=g)  # [N]; some of the 8 groups stay empty
    rewards = torch.where(torch.rand(50, generator=g) < 0.4, 1.0, -1.0)  # [N]
    means, counts = group_mean_py(rewards.tolist(), group.tolist(), 8)
    assert means == group_mean(rewards, group, 8).tolist()
    assert counts == torch.bincount(group, minlength=8).tolist() and counts[7] == 0 and means[7] == 0.0
