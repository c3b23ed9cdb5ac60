"""Tests of lit_rlvr.optim.ivon: seeded sampling, equality with stock ivon-opt, restore, state, dtypes,
Lightning manual optimization and FSDP2/DTensor shard-local sampling."""

from __future__ import annotations

import copy
import io

import ivon
import pytest
import torch
from torch import nn

from lit_rlvr.optim import IVON, bf16_spacing_warning, sample_seed

KW = dict(lr=0.1, ess=1e3, hess_init=0.1, weight_decay=1e-4, beta2=0.99)  # σ ≈ 0.1: visible noise


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).float() - y).square().mean()


def _train_sample(opt: IVON, model: nn.Module, step: int, sample_index: int) -> None:
    with opt.sampled_params(sample_index=sample_index, train=True):
        opt.zero_grad()
        _loss(model, *_batch(step)).backward()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def _delta(opt: IVON, model: nn.Module, **kw) -> torch.Tensor:
    mean = _flat(model)
    with opt.sampled_params(**kw):
        return _flat(model) - mean


def _assert_same_state(a: IVON, b, check_step: bool = True) -> None:
    for ga, gb in zip(a.param_groups, b.param_groups):
        assert torch.equal(ga["hess"], gb["hess"]) and torch.equal(ga["momentum"], gb["momentum"])
        for pa, pb in zip(ga["params"], gb["params"]):
            assert torch.equal(pa.detach(), pb.detach())
    if check_step:
        assert a.current_step == b.current_step


def test_same_seed_same_noise_and_every_key_changes_it():
    model = _model()
    base = _delta(IVON(model.parameters(), seed=7, **KW), model)
    assert torch.equal(base, _delta(IVON(model.parameters(), seed=7, **KW), model))
    assert base.abs().min() > 0
    for kw, opt_kw in (({"sample_index": 1}, {}), ({}, {"rank": 1}), ({}, {"seed": 8})):
        other = _delta(IVON(model.parameters(), **{"seed": 7, **KW, **opt_kw}), model, **kw)
        assert not torch.allclose(base, other), (kw, opt_kw)
    opt = IVON(model.parameters(), seed=7, **KW)
    opt.current_step = 1  # the step is part of the seed
    assert not torch.allclose(base, _delta(opt, model))


def test_noise_is_sigma_times_seeded_normal():
    model = _model()
    opt = IVON(model.parameters(), seed=3, rank=2, **KW)
    delta = _delta(opt, model, sample_index=5)
    w = model[0].weight
    gen = torch.Generator().manual_seed(sample_seed(3, 0, 5, 2, 0))  # param index 0 = first Linear's weight
    eps = torch.randn(w.numel(), generator=gen)
    sigma = 1.0 / (KW["ess"] * (KW["hess_init"] + KW["weight_decay"])) ** 0.5
    torch.testing.assert_close(delta[: w.numel()], sigma * eps, rtol=0, atol=1e-6)


def test_sigma_follows_every_change_of_h_lambda_and_delta():
    """σ is cached between samples; any change of h (in place or replaced), λ or δ must reach the next sample."""
    model = _model()
    opt = IVON(model.parameters(), **KW)
    group = opt.param_groups[0]
    scale = lambda: (group["ess"] * (group["hess"] + group["weight_decay"])).sqrt()  # 1/σ, [numel]
    eps = _delta(opt, model, sample_index=1) * scale()  # the seeded normal draw of sample 1
    for change in (lambda: group["hess"].mul_(4.0), lambda: group.update(hess=group["hess"] * 4.0),
                   lambda: group.update(ess=group["ess"] * 4.0), lambda: group.update(weight_decay=0.5)):
        change()
        # θ − m rounds at |m|
        torch.testing.assert_close(_delta(opt, model, sample_index=1), eps / scale(), rtol=1e-4, atol=1e-7)


def _stock_enter(stock: ivon.IVON, eps_groups: list[torch.Tensor], monkeypatch):
    """Enter stock sampled_params(train=True) with torch.randn replaced by our ε, one draw per group."""
    draws = iter(eps_groups)
    with monkeypatch.context() as mp:
        mp.setattr(torch, "randn", lambda n, device=None, dtype=None: next(draws).clone())
        ctx = stock.sampled_params(train=True)
        ctx.__enter__()
    return ctx


@pytest.mark.parametrize("hess_approx", ["price", "gradsq"])
def test_update_equals_stock_ivon_given_same_noise(hess_approx, monkeypatch):
    ours_model, stock_model = _model(), _model()

    def groups(m):  # two groups with different lr: checks the per-group slicing too
        return [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 0.05}]

    kw = dict(KW, hess_approx=hess_approx, clip_radius=1.0)
    ours = IVON(groups(ours_model), seed=11, **kw)
    stock = ivon.IVON(groups(stock_model), **kw)
    for step in range(3):
        for j in range(2):  # two MC samples per step
            eps = ours._standard_normal(j)
            with ours.sampled_params(sample_index=j, train=True):
                ours.zero_grad()
                _loss(ours_model, *_batch(step)).backward()
                theta = _flat(ours_model)
            ctx = _stock_enter(stock, eps, monkeypatch)
            stock.zero_grad()
            _loss(stock_model, *_batch(step)).backward()
            assert torch.equal(theta, _flat(stock_model))
            ctx.__exit__(None, None, None)
        ours.step()
        stock.step()
        _assert_same_state(ours, stock)


def test_generation_samples_do_not_disturb_accumulation():
    model_a, model_b = _model(), _model()
    opt_a, opt_b = IVON(model_a.parameters(), **KW), IVON(model_b.parameters(), **KW)
    _train_sample(opt_a, model_a, 0, 0)
    count, avg_grad = opt_a.state["count"], opt_a.state["avg_grad"].clone()
    for j in (5, 6):  # generation-only samples, as C3PO's chunks
        with torch.no_grad(), opt_a.sampled_params(sample_index=j, train=False):
            model_a(_batch(0)[0])
    assert opt_a.state["count"] == count and torch.equal(opt_a.state["avg_grad"], avg_grad)
    _train_sample(opt_a, model_a, 0, 1)
    _train_sample(opt_b, model_b, 0, 0)
    _train_sample(opt_b, model_b, 0, 1)
    opt_a.step()
    opt_b.step()
    _assert_same_state(opt_a, opt_b)


def test_mean_restored_bit_exactly_also_after_exception():
    model = _model()
    opt = IVON(model.parameters(), **KW)
    before = [p.detach().clone() for p in model.parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]
    with opt.sampled_params(sample_index=3):
        assert not torch.equal(model[0].weight, before[0])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="boom"):
        with opt.sampled_params(sample_index=4, train=True):
            _loss(model, *_batch(0)).backward()
            raise ValueError("boom")
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # written in place, storage kept
    assert opt.state["count"] == 0  # an interrupted sample is not recorded
    with opt.sampled_params():  # usable again
        with pytest.raises(RuntimeError, match="already active"):
            with opt.sampled_params(sample_index=1):
                pass
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_stack_equals_each_sampled_params_bit_for_bit(dtype):
    model = _model(dtype=dtype)
    opt = IVON(model.parameters(), **KW)
    _train_sample(opt, model, 0, 0)
    opt.step()  # h is no longer uniform: σ differs per element
    mean = [p.detach().clone() for p in model.parameters()]
    stacks = opt.sampled_stack([2, 0, 5])
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), mean))  # the parameters were not touched
    for row, index in enumerate([2, 0, 5]):
        with opt.sampled_params(sample_index=index):
            for p, stack in zip(model.parameters(), stacks):
                assert stack.shape == (3, *p.shape) and stack.dtype == dtype
                assert torch.equal(stack[row], p)
    assert not torch.equal(stacks[0][0], stacks[0][1])


def test_state_dict_round_trip_continues_identically():
    model_a = _model()
    opt_a = IVON(model_a.parameters(), seed=5, **KW)
    for step in range(2):
        _train_sample(opt_a, model_a, step, 0)
        opt_a.step()
    _train_sample(opt_a, model_a, 2, 0)  # a pending sample is part of the state too
    buffer = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert saved["opt"]["current_step"] == 2 and "hess" in saved["opt"]["param_groups"][0]

    model_b = _model(seed=123)
    model_b.load_state_dict(saved["model"])
    opt_b = IVON(model_b.parameters(), seed=5, **KW)
    opt_b.load_state_dict(saved["opt"])
    assert opt_b.current_step == 2 and opt_b.state["count"] == 1
    _assert_same_state(opt_a, opt_b)
    for opt, model in ((opt_a, model_a), (opt_b, model_b)):
        _train_sample(opt, model, 2, 1)
        opt.step()
        for step in (3, 4):
            _train_sample(opt, model, step, 0)
            opt.step()
    _assert_same_state(opt_a, opt_b)
    assert opt_b.current_step == 5


def test_params_without_grad_and_step_without_sample():
    model = _model()
    unused = nn.Linear(3, 3)
    model[2].bias.requires_grad_(False)
    opt = IVON(list(model.parameters()) + list(unused.parameters()), **KW)
    with pytest.raises(RuntimeError, match="sampled_params\\(train=True\\)"):
        opt.step()
    before = _flat(model)
    _train_sample(opt, model, 0, 0)
    assert unused.weight.grad is None and model[2].bias.grad is None
    opt.step()
    assert torch.isfinite(_flat(model)).all() and not torch.equal(before, _flat(model))
    assert all(torch.isfinite(g["hess"]).all() for g in opt.param_groups)


def test_bf16_params_keep_fp32_state():
    model = _model(dtype=torch.bfloat16)
    params = list(model.parameters())
    opt = IVON(params, **KW)
    for step in range(2):
        _train_sample(opt, model, step, 0)
        assert opt.state["avg_grad"].dtype == torch.float32 and opt.state["avg_nxg"].dtype == torch.float32
        opt.step()
    group = opt.param_groups[0]
    assert group["hess"].dtype == torch.float32 and group["momentum"].dtype == torch.float32
    assert all(s.dtype == torch.float32 for s in opt.sigma())
    assert list(model.parameters()) == params and all(p.dtype == torch.bfloat16 for p in params)
    assert not torch.equal(group["hess"], torch.full_like(group["hess"], KW["hess_init"]))


def test_sigma_and_noise_stats():
    model = _model()
    opt = IVON(model.parameters(), **KW)
    expected = 1.0 / (KW["ess"] * (KW["hess_init"] + KW["weight_decay"])) ** 0.5
    sig = opt.sigma()
    assert [s.shape for s in sig] == [p.shape for p in model.parameters()]
    stats = opt.noise_stats()
    assert set(stats) == {"noise/sigma_mean", "noise/param_delta_rms", "noise/relative", "noise/numel"}
    assert stats["noise/numel"] == sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in stats.values())
    torch.testing.assert_close(stats["noise/sigma_mean"], torch.tensor(expected))
    assert stats["noise/param_delta_rms"] == 0
    delta = _delta(opt, model)
    torch.testing.assert_close(opt.noise_stats()["noise/param_delta_rms"], delta.square().mean().sqrt())


def test_bf16_spacing_warning():
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)  # bf16 spacing at 0.5 is 2^-8 ≈ 3.9e-3
    assert bf16_spacing_warning(IVON(model.parameters(), **KW), model.parameters()) is None  # σ ≈ 0.1
    tiny = IVON(model.parameters(), **dict(KW, ess=1e12))  # σ ≈ 3e-6
    message = bf16_spacing_warning(tiny, model.parameters())
    assert message is not None and "bf16" in message


def test_lightning_manual_optimization_steps_and_matches_plain_loop():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    xs, ys = zip(*(_batch(s) for s in range(3)))
    data = TensorDataset(torch.cat(xs), torch.cat(ys))

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = _model()

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()  # the LightningOptimizer wrapper: must see the live current_step
            for j in range(2):
                with opt.sampled_params(sample_index=j, train=True):
                    opt.zero_grad()
                    self.manual_backward(_loss(self.net, *batch))
            opt.step()

        def configure_optimizers(self):
            return IVON(self.parameters(), seed=9, **KW)

        def train_dataloader(self):
            return DataLoader(data, batch_size=16, shuffle=False)

    module = Module()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    assert trainer.global_step == 3 and trainer.optimizers[0].current_step == 3

    model = _model()
    opt = IVON(model.parameters(), seed=9, **KW)
    for step in range(3):
        for j in range(2):
            _train_sample(opt, model, step, j)
        opt.step()
    _assert_same_state(trainer.optimizers[0], opt)


def test_dtensor_sampling_is_shard_local(gloo_world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    w = torch.randn(6, 3)
    param = nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    opt = IVON([param], seed=4, rank=3, **KW)  # rank is not used for DTensors: the shard coordinate is
    local = param.to_local().detach()
    mean, ptr = local.clone(), local.data_ptr()
    gen = torch.Generator().manual_seed(sample_seed(4, 0, 2, 0, 0))
    eps = torch.randn(local.numel(), generator=gen).view(local.shape)
    sigma = opt.sigma()[0]
    with opt.sampled_params(sample_index=2):
        torch.testing.assert_close(param.to_local(), mean + sigma * eps, rtol=0, atol=1e-6)
        assert torch.equal(param.full_tensor(), param.to_local())
    assert torch.equal(param.to_local(), mean) and param.to_local().data_ptr() == ptr


def test_fsdp2_model_steps_like_plain_model(gloo_world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (1,))
    plain = _model()
    sharded = copy.deepcopy(plain)
    for layer in (sharded[0], sharded[2], sharded):
        fully_shard(layer, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    opt_plain, opt_sharded = IVON(plain.parameters(), **KW), IVON(sharded.parameters(), **KW)
    for step in range(2):
        for opt, model in ((opt_plain, plain), (opt_sharded, sharded)):
            for j in range(2):
                _train_sample(opt, model, step, j)
            opt.step()
    for a, b in zip(plain.parameters(), sharded.parameters()):
        assert torch.equal(a.detach(), b.to_local().detach())
    for ga, gb in zip(opt_plain.param_groups, opt_sharded.param_groups):
        assert torch.equal(ga["hess"], gb["hess"])
    with pytest.raises(ValueError, match="sync=False"):
        IVON(sharded.parameters(), sync=True, **KW)


# -- edges found by mutation testing (scripts/mutation.py) ---------------------------------------------------------
def test_a_missing_grad_counts_as_a_zero_grad():
    """The oracle: the same step with that parameter's .grad set to zeros. h, momentum and every weight equal."""
    runs = []
    for explicit_zero in (False, True):
        model = _model()
        opt = IVON(model.parameters(), **KW)
        with opt.sampled_params(sample_index=0, train=True):
            opt.zero_grad(set_to_none=True)
            _loss(model, *_batch(0)).backward()
            model[2].bias.grad = torch.zeros_like(model[2].bias) if explicit_zero else None
        opt.step()
        runs.append((model, opt))
    _assert_same_state(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][1].param_groups[0]["momentum"], torch.zeros_like(
        runs[0][1].param_groups[0]["momentum"]))


def test_non_contiguous_parameter_samples_and_steps_like_its_contiguous_copy():
    """A transposed (non-contiguous) weight holds the same values as a contiguous one: the same seeded noise in
    row-major order, the same step, and its storage (and strides) kept."""
    torch.manual_seed(3)
    values = torch.randn(4, 3)
    plain = nn.Parameter(values.clone())
    strided = nn.Parameter(values.t().contiguous().t())  # [4, 3] with strides (1, 4)
    assert not strided.is_contiguous()
    opts = [IVON([p], seed=5, **KW) for p in (plain, strided)]
    ptr, stride = strided.data_ptr(), strided.stride()
    x = torch.randn(4)
    thetas = []
    for opt, p in zip(opts, (plain, strided)):
        with opt.sampled_params(sample_index=1, train=True):
            theta = p.detach().clone()
            thetas.append(theta)
            opt.zero_grad()
            (x @ p).square().sum().backward()
        opt.step()
        gen = torch.Generator().manual_seed(sample_seed(5, 0, 1, 0, 0))
        sigma0 = (KW["ess"] * (KW["hess_init"] + KW["weight_decay"])) ** -0.5  # h = h0 before the first step
        torch.testing.assert_close(theta, values + sigma0 * torch.randn(12, generator=gen).view(4, 3))
    assert torch.equal(thetas[0], thetas[1])  # m + σ⊙ε: elementwise on the same flat row-major copy, bit for bit
    # x @ p runs another BLAS kernel for the transposed layout (AVX-512 MKL on a Xeon sums in another order): the
    # gradients, so the steps, agree to fp32 rounding, not bit for bit
    torch.testing.assert_close(strided.detach(), plain.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(plain.detach(), values)
    assert strided.data_ptr() == ptr and strided.stride() == stride


def test_mc_samples_closure_is_called_per_sample_and_its_losses_averaged():
    """mc_samples = 2 with a closure that records its own sample (ivon-opt's protocol): step() calls it twice,
    returns the mean loss, and updates from the mean of the two gradients — the oracle: the same two samples
    recorded by hand and one step() without a closure."""
    model_a, model_b = _model(), _model()
    opt_a = IVON(model_a.parameters(), mc_samples=2, **KW)
    opt_b = IVON(model_b.parameters(), **KW)
    calls, losses = [], []

    def closure():
        index = len(calls)
        calls.append(index)
        with opt_a.sampled_params(sample_index=index, train=True):
            opt_a.zero_grad()
            loss = _loss(model_a, *_batch(index))
            loss.backward()
        losses.append(loss.detach())
        return loss

    returned = opt_a.step(closure)
    assert calls == [0, 1]
    torch.testing.assert_close(returned.detach(), (losses[0] + losses[1]) / 2)
    for index in (0, 1):
        _train_sample(opt_b, model_b, index, index)
    opt_b.step()
    _assert_same_state(opt_a, opt_b)
    # a closure that returns None (Lightning's in manual optimization) is called once
    _train_sample(opt_a, model_a, 5, 0)
    seen = []
    assert opt_a.step(lambda: seen.append(1)) is None and seen == [1]


def test_sample_seed_is_a_63_bit_blake2b_of_the_five_integers():
    """The seed format is part of what a resumed run relies on (the same noise after a restart): blake2b with an
    8-byte digest of the five little-endian int64s, top bit cleared. Over 200 inputs every bit 0..62 is set
    somewhere and bit 63 nowhere."""
    import hashlib
    import struct

    seeds = [sample_seed(s, t, j, r, i) for s, t, j, r, i in
             [(0, 0, 0, 0, 0), (1, 2, 3, 4, 5), (-1, 7, 0, 2, 9)] + [(9, k, k % 3, 1, k % 7) for k in range(197)]]
    for (s, t, j, r, i), seed in zip([(0, 0, 0, 0, 0), (1, 2, 3, 4, 5), (-1, 7, 0, 2, 9)], seeds):
        digest = hashlib.blake2b(struct.pack("<5q", s, t, j, r, i), digest_size=8).digest()
        assert seed == int.from_bytes(digest, "little") % 2**63
    assert all(0 <= seed < 2**63 for seed in seeds)
    union = 0
    for seed in seeds:
        union |= seed
    assert union == 2**63 - 1


class _Mesh:
    def __init__(self, shape, coordinate):
        self.shape, self.coordinate = shape, coordinate

    def get_coordinate(self):
        return self.coordinate

    def size(self, dim):
        return self.shape[dim]


class _FakeDTensor:
    def __init__(self, mesh, placements):
        self.device_mesh, self.placements = mesh, placements


def test_shard_keys_on_meshes_of_several_dimensions(monkeypatch):
    """The shard key is the row-major index of the coordinate over the mesh dims the tensor is sharded on
    (replicated dims left out, so replicas draw the same noise): on a 2 × 3 mesh sharded on both, the six ranks
    get 0..5; sharded on dim 1 only, key = coordinate[1]; on dim 0 only, coordinate[0]; on a 2 × 2 × 3 mesh,
    (c0·2 + c1)·3 + c2. A rank holding no part gets 0; a plain tensor, the optimizer's rank."""
    from torch.distributed.tensor import Replicate, Shard

    import lit_rlvr.optim.ivon as ivon_module

    monkeypatch.setattr(ivon_module, "DTensor", _FakeDTensor)
    opt = type("Opt", (), {"rank": 7})()
    key = lambda shape, coord, placements: IVON._shard_key(opt, _FakeDTensor(_Mesh(shape, coord), placements))  # noqa: E731
    coords = [(a, b) for a in range(2) for b in range(3)]
    assert [key((2, 3), c, [Shard(0), Shard(1)]) for c in coords] == [0, 1, 2, 3, 4, 5]
    assert [key((2, 3), c, [Replicate(), Shard(0)]) for c in coords] == [0, 1, 2, 0, 1, 2]
    assert [key((2, 3), c, [Shard(1), Replicate()]) for c in coords] == [0, 0, 0, 1, 1, 1]
    assert key((2, 2, 3), (1, 0, 2), [Shard(0), Shard(1), Shard(0)]) == (1 * 2 + 0) * 3 + 2
    assert key((2, 3), None, [Shard(0), Shard(1)]) == 0
    assert IVON._shard_key(opt, torch.zeros(1)) == 7
