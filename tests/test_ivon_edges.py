"""Edges that scripts/mutation.py found unchecked (docs/mutation.md): each test kills named mutants."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lit_rlvr.optim import IVON, bf16_spacing_warning, sample_seed

KW = dict(lr=0.1, ess=1e3, hess_init=0.1, weight_decay=1e-4, beta2=0.99)  # σ ≈ 0.1: visible noise


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def _loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + seed)
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
    return (model(x) - y).square().mean()


def _train_sample(opt: IVON, model: nn.Module, sample_index: int = 0) -> None:
    with opt.sampled_params(sample_index=sample_index, train=True):
        opt.zero_grad()
        _loss(model).backward()


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in params])


def _sigma0(ess: float, hess_init: float, weight_decay: float) -> float:
    return 1.0 / math.sqrt(ess * (hess_init + weight_decay))


# -- defaults (the paper's LLM settings: conf/algorithm/c3po.yaml names them "paper: …") ----------------------------
def test_documented_defaults_hold_when_not_passed():
    """IVON(params, lr, ess) uses h0 = 1e-3, δ = 1e-6, β1 = 0.9, β2 = 0.9999 (the signature's paper defaults, as
    conf/algorithm/c3po.yaml quotes them), seed 0 and rank 0: h starts at h0, σ = 1/sqrt(λ(h0 + δ)) and the noise
    of parameter 0 is seeded by sample_seed(0, 0, 0, 0, 0)."""
    p = nn.Parameter(torch.zeros(5))
    opt = IVON([p], lr=0.1, ess=4.0)
    group = opt.param_groups[0]
    assert (group["hess_init"], group["weight_decay"], group["beta1"], group["beta2"]) == (1e-3, 1e-6, 0.9, 0.9999)
    assert opt.seed == 0 and opt.rank == 0
    assert torch.equal(group["hess"], torch.full((5,), 1e-3))
    sigma = _sigma0(4.0, 1e-3, 1e-6)
    torch.testing.assert_close(opt.sigma()[0], torch.full((5,), sigma))
    gen = torch.Generator().manual_seed(sample_seed(0, 0, 0, 0, 0))
    with opt.sampled_params():
        torch.testing.assert_close(p.detach(), sigma * torch.randn(5, generator=gen))


def test_default_mc_samples_calls_the_closure_once_and_returns_its_loss():
    """mc_samples defaults to 1: step(closure) calls a loss-returning closure once and returns that loss as is
    (torch's step(closure) convention; no averaging over one sample, which would detach it into a copy)."""
    model = _model()
    opt = IVON(model.parameters(), lr=0.1, ess=1e3)
    losses = []

    def closure():
        with opt.sampled_params(train=True):
            opt.zero_grad()
            loss = _loss(model)
            loss.backward()
        losses.append(loss)
        return loss

    returned = opt.step(closure)
    assert opt.mc_samples == 1 and len(losses) == 1
    assert returned is losses[0] and returned.requires_grad


def test_sample_params_defaults_to_sample_zero_and_keeps_the_noise():
    """`_sample_params()` without arguments (ivon-opt's own call) writes sample 0 and returns the noise σ⊙ε it
    added (keep_noise=True), one flat tensor per group: what sampled_params(0) writes, θ − m."""
    model = _model()
    opt = IVON(model.parameters(), **KW)
    mean = _flat(model.parameters())
    with opt.sampled_params(sample_index=0):
        expected = _flat(model.parameters())
    param_avg, noise = opt._sample_params()
    try:
        assert torch.equal(_flat(model.parameters()), expected)
        assert len(noise) == 1 and torch.allclose(noise[0], expected - mean, rtol=0, atol=1e-6)
    finally:
        opt._restore_param_average(False, param_avg, noise)
    assert torch.equal(_flat(model.parameters()), mean)


# -- construction checks --------------------------------------------------------------------------------------------
def test_parameters_on_two_devices_are_refused():
    """IVON keeps flat per-group buffers on one device: a cpu and a meta parameter (two devices) raise."""
    with pytest.raises(ValueError, match="several devices"):
        IVON([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))], **KW)


def test_sync_is_refused_when_any_parameter_is_a_dtensor(gloo_world_of_one):
    """sync=True would sum different shards: one DTensor among plain parameters is enough to refuse it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sharded = nn.Parameter(distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]))
    plain = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="sync=False"):
        IVON([plain, sharded], sync=True, **KW)
    IVON([plain], sync=True, **KW)  # plain parameters only: allowed


def test_sync_without_a_process_group_steps_like_no_sync():
    """sync=True only all-reduces when torch.distributed is initialized; in a single process it is a no-op and the
    step equals sync=False's bit for bit."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    runs = []
    for sync in (True, False):
        model = _model()
        opt = IVON(model.parameters(), sync=sync, seed=2, **KW)
        _train_sample(opt, model)
        opt.step()
        runs.append((_flat(model.parameters()), opt.param_groups[0]["hess"]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


# -- an empty posterior ---------------------------------------------------------------------------------------------
def test_an_empty_param_group_records_an_empty_gradient_sample():
    """A posterior over no weights (one empty param group): the recorded gradient sample has one entry per weight,
    i.e. none, and step() runs."""
    opt = IVON([{"params": []}], **KW)
    with opt.sampled_params(train=True):
        pass
    assert opt.state["avg_grad"].shape == (0,) and opt.state["avg_nxg"].shape == (0,)
    opt.step()
    assert opt.current_step == 1 and opt.noise_stats()["noise/numel"] == 0


# -- the σ cache ----------------------------------------------------------------------------------------------------
def test_noise_scales_are_cached_while_h_lambda_and_delta_stay_the_same():
    """`_noise_scales` is computed once per h (a step samples 1 + N times): without a change the same tensors come
    back; after a step (new h) new ones."""
    model = _model()
    opt = IVON(model.parameters(), **KW)
    first = opt._noise_scales()
    second = opt._noise_scales()
    assert len(first) == 1 and all(a is b for a, b in zip(first, second))
    _train_sample(opt, model)
    opt.step()
    third = opt._noise_scales()
    assert third[0] is not first[0]
    assert torch.equal(third[0], (KW["ess"] * (opt.param_groups[0]["hess"] + KW["weight_decay"])).sqrt())


def test_a_change_of_h_in_one_group_reaches_that_groups_next_sample():
    """With two groups, changing h of the second group only (in place) must reach its noise: every group's key
    must match for the cache to be used."""
    model = _model()
    opt = IVON([{"params": model[0].parameters()}, {"params": model[2].parameters()}], **KW)
    before = [s.clone() for s in opt._noises(1)]
    eps = opt._standard_normal(1)
    hess = opt.param_groups[1]["hess"].mul_(4.0)  # σ of group 2 about halves
    after = opt._noises(1)
    assert torch.equal(after[0], before[0])
    torch.testing.assert_close(after[1], eps[1] / (KW["ess"] * (hess + KW["weight_decay"])).sqrt())
    assert not torch.allclose(after[1], before[1])


# -- noise metrics and σ per parameter -------------------------------------------------------------------------------
def test_noise_stats_of_a_single_weight_are_its_sigma_and_its_perturbation():
    """With one weight, noise/sigma_mean is that weight's σ, noise/param_delta_rms is |θ − m| and noise/relative
    |θ − m| / |m| (means over one element)."""
    p = nn.Parameter(torch.tensor([0.25]))
    opt = IVON([p], **KW)
    sigma = _sigma0(KW["ess"], KW["hess_init"], KW["weight_decay"])
    stats = opt.noise_stats()
    torch.testing.assert_close(stats["noise/sigma_mean"], torch.tensor(sigma))
    with opt.sampled_params(sample_index=3):
        delta = (p.detach() - 0.25).abs()[0]
    assert delta > 0
    stats = opt.noise_stats()
    torch.testing.assert_close(stats["noise/param_delta_rms"], delta)
    torch.testing.assert_close(stats["noise/relative"], delta / 0.25)  # against the mean's size, |m| = 0.25


def test_param_delta_rms_counts_the_rounding_of_mixed_dtype_groups():
    """One group with a bf16 and an fp32 parameter: noise/param_delta_rms is the RMS of θ − m as written, so the
    bf16 weight's perturbation is the rounded one (around |m| = 64 the bf16 spacing, 0.25 below and 0.5 above,
    rounds most draws of σ ≈ 0.1 to 0)."""
    big = nn.Parameter(torch.full((64,), 64.0, dtype=torch.bfloat16))
    small = nn.Parameter(torch.zeros(8))
    opt = IVON([big, small], **KW)
    mean = _flat([big, small])
    with opt.sampled_params(sample_index=2):
        delta = _flat([big, small]) - mean
    rms = opt.noise_stats()["noise/param_delta_rms"]
    torch.testing.assert_close(rms, delta.square().mean().sqrt(), rtol=1e-5, atol=0)
    assert torch.equal(delta[:64], (delta[:64] * 4).round() / 4)  # the bf16 part lies on its 0.25 grid


def test_sigma_of_each_parameter_is_its_own_slice_of_h():
    """sigma() returns, per parameter and in order, 1/sqrt(λ(h + δ)) of that parameter's slice of the group's h;
    after a step h differs per element, so a wrong slice shows."""
    model = _model()
    opt = IVON(model.parameters(), **KW)
    _train_sample(opt, model)
    opt.step()
    hess = opt.param_groups[0]["hess"]
    assert hess.unique().numel() > 1
    expected = 1.0 / (KW["ess"] * (hess + KW["weight_decay"])).sqrt()
    sig = opt.sigma()
    assert [s.shape for s in sig] == [p.shape for p in model.parameters()]
    assert torch.equal(torch.cat([s.flatten() for s in sig]), expected)


# -- debiasing --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("debias", [True, False])
def test_one_step_by_hand_with_and_without_debiasing(debias):
    """A linear loss (constant gradient c) with hess_approx="gradsq" makes one step independent of the noise:
    g = (1 − β1)c, h = β2h0 + (1 − β2)f + ½(1 − β2)²(h0 − f)²/(h0 + δ) with f = λc², and
    m ← m − lr(h0 + δ)·(g/d + δm)/(h + δ), d = 1 − β1 with debiasing, 1 without (module docstring, Alg. 1)."""
    m0, c = [0.3, -0.2], [0.5, -1.0]
    lr, ess, h0, b1, b2, wd = 0.1, 100.0, 0.2, 0.5, 0.9, 1e-3
    p = nn.Parameter(torch.tensor(m0))
    opt = IVON([p], lr=lr, ess=ess, hess_init=h0, beta1=b1, beta2=b2, weight_decay=wd, hess_approx="gradsq",
               debias=debias)
    with opt.sampled_params(train=True):
        opt.zero_grad()
        (torch.tensor(c) * p).sum().backward()
    opt.step()
    d = 1.0 - b1 if debias else 1.0
    expected = []
    for m, g in zip(m0, c):
        f = ess * g * g
        h = b2 * h0 + (1 - b2) * f + 0.5 * (1 - b2) ** 2 * (h0 - f) ** 2 / (h0 + wd)
        expected.append(m - lr * (h0 + wd) * ((1 - b1) * g / d + wd * m) / (h + wd))
    torch.testing.assert_close(p.detach(), torch.tensor(expected), rtol=1e-5, atol=1e-7)


# -- bf16_spacing_warning: the boundaries of "σ below the bf16 spacing of mean |w|" -----------------------------------
def _sigma_opt(sigma_times_256: float) -> IVON:
    """An optimizer whose σ is sigma_times_256 · 2^-8: h0 = 1, δ = 0, λ = 2^16 / sigma_times_256² (exact for 1)."""
    return IVON([nn.Parameter(torch.zeros(3))], lr=0.1, ess=65536.0 / sigma_times_256 ** 2, hess_init=1.0,
                weight_decay=0.0)


def test_bf16_warning_not_given_when_sigma_equals_the_spacing():
    """mean |w| = 0.5 (one weight): spacing = 2^-7 · 2^⌊log2 0.5⌋ = 2^-8. σ = 2^-8 exactly is not below it: None."""
    opt = _sigma_opt(1.0)
    assert float(opt.noise_stats()["noise/sigma_mean"]) == 2.0 ** -8
    assert bf16_spacing_warning(opt, [torch.tensor([0.5])]) is None
    assert bf16_spacing_warning(opt, [torch.tensor([-0.5, 0.5]), torch.tensor([[0.5]])]) is None


def test_bf16_warning_given_for_a_single_weight_when_sigma_is_below():
    """One reference weight of 0.5 (spacing 2^-8) and σ = ¾ · 2^-8: below, so a message (one weight is enough)."""
    message = bf16_spacing_warning(_sigma_opt(0.75), [torch.tensor([0.5])])
    assert message is not None and "mean |w| = 0.5" in message


def test_bf16_spacing_uses_the_binade_below_the_typical_weight():
    """mean |w| = 0.75 lies in [0.5, 1): the bf16 spacing there is 2^-7 · 2^-1 = 2^-8 (floor of log2, not ceil):
    σ = 1.5 · 2^-8 is not below it; σ = 0.9 · 2^-8 is."""
    weights = [torch.full((4,), 0.75), torch.full((2,), -0.75)]
    assert bf16_spacing_warning(_sigma_opt(1.5), weights) is None
    assert bf16_spacing_warning(_sigma_opt(0.9), weights) is not None


def test_bf16_warning_none_for_zero_or_no_reference_weights():
    """No reference weights, or all zero: there is no typical magnitude to compare with, so None (no log2(0))."""
    opt = _sigma_opt(0.01)
    assert bf16_spacing_warning(opt, []) is None
    assert bf16_spacing_warning(opt, [torch.zeros(3), torch.zeros(2, 2)]) is None
