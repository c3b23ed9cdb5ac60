"""3PO (`lit_rlvr.callbacks.ParamNoise`, docs/architecture.md §5) on the tiny model: which weights generated each
chunk and took the gradient, that m comes back, the config errors, the three variants end to end, and `train.py`."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr import functional as F
from lit_rlvr.callbacks import ParamNoise
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.hooks import check_rl_callbacks
from lit_rlvr.module import GRPOModule
from lit_rlvr.optim import IVON, sample_seed
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from lit_rlvr.update import Update
from tiny_options import TINY as TINY_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
CACHE = os.environ.get("LIT_RLVR_CACHE") or str(Path(tempfile.gettempdir()) / "lit_rlvr_test_cache")
TINY = {"cache_dir": CACHE, **TINY_OPTIONS}  # = conf/model/tiny.yaml
ESS, H0, DELTA, CLIP = 1e7, 1e-3, 1e-6, 1.0
IVON_OPTIONS = {"ess": ESS, "hess_init": H0, "weight_decay": DELTA, "clip_radius": CLIP}


def make_module(**overrides) -> GRPOModule:
    args = dict(model="tiny", model_options=TINY, group_size=4, max_new_tokens=4, lr=1.0, grad_clip=0.0,
                optimizer="ivon", optimizer_options=IVON_OPTIONS, engine_options={"mode": "copy"}, seed=3,
                seq_mask_tau=1e3)  # on, but wide: at σ ≈ 0.01 the warm-up of some CPUs (a sharper tiny model) puts
    # every sequence's ratio between two samples outside τ = 2; these tests check which weights generate and take the
    # loss, not the mask
    args.update(overrides)
    return GRPOModule(**args)


def fit(module: GRPOModule, callback: ParamNoise, steps: int, log_dir: Path | None = None) -> pl.Trainer:
    data = RLVRDataModule(task="arithmetic", batch_size=2, eval_batch_size=16, num_train=64, num_test=16,
                          seed=module.settings.seed)  # the logger merges both hparams: seeds must agree
    logger = CSVLogger(str(log_dir), name="", version="") if log_dir else False
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=logger, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1)
    trainer.fit(module, datamodule=data)
    return trainer


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float() for t in tensors])


def spy_engine_pushes(module: GRPOModule, monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Record every push to the engine (`copy` mode): one {name: tensor} dict per push, filled bucket by bucket."""
    pushed: list[dict[str, torch.Tensor]] = []
    first = next(n for n, _ in module.policy.named_parameters())
    real_setup = module.setup

    def setup_with_spy(stage):
        real_setup(stage)
        real_load = module.engine.load_weights

        def load_spy(named):
            named = list(named)
            if not pushed or first in (n for n, _ in named):
                pushed.append({})
            pushed[-1].update({n: t.detach().clone() for n, t in named})
            real_load(named)

        monkeypatch.setattr(module.engine, "load_weights", load_spy)

    monkeypatch.setattr(module, "setup", setup_with_spy)
    return pushed


def expected_sample(mean: list[torch.Tensor], seed: int, sample_index: int) -> list[torch.Tensor]:
    """θ = m + σ⊙z at IVON step 0 (h = h0 everywhere), rebuilt from the documented seeding, not from IVON."""
    sigma = 1.0 / math.sqrt(ESS * (H0 + DELTA))
    out = []
    for i, m in enumerate(mean):
        gen = torch.Generator().manual_seed(sample_seed(seed, 0, sample_index, 0, i))
        out.append(m + sigma * torch.randn(m.numel(), generator=gen).view(m.shape))
    return out


# -- C3PO: which weights did what ----------------------------------------------------------------------------
def test_c3po_chunks_from_distinct_samples_loss_at_a_third_and_mean_restored(monkeypatch):
    module = make_module(seed=3)
    names = [n for n, _ in module.policy.named_parameters()]
    m0 = [p.detach().clone() for p in module.policy.parameters()]
    pushed = spy_engine_pushes(module, monkeypatch)
    loss_weights: list[list[torch.Tensor]] = []
    before_step: list[list[torch.Tensor]] = []

    real_forward = Update.forward_logprobs

    def forward_spy(update, model, rollouts):
        if model is module.policy and torch.is_grad_enabled():
            loss_weights.append([p.detach().clone() for p in module.policy.parameters()])
        return real_forward(update, model, rollouts)

    real_step = IVON.step

    def step_spy(self, closure=None):
        before_step.append([p.detach().clone() for group in self.param_groups for p in group["params"]])
        return real_step(self, closure)

    monkeypatch.setattr(Update, "forward_logprobs", forward_spy)
    monkeypatch.setattr(IVON, "step", step_spy)
    trainer = fit(module, ParamNoise("c3po", num_samples=2), steps=1)

    # pushes: chunk 0, chunk 1, then the new mean after the step
    assert len(pushed) == 3, [len(p) for p in pushed]
    for c in range(2):
        want = expected_sample(m0, seed=3, sample_index=c)
        got = [pushed[c][n] for n in names]
        for n, g, w in zip(names, got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=f"chunk {c}, {n}")
    delta01 = (flat(pushed[0][n] for n in names) - flat(pushed[1][n] for n in names)).abs().max()
    assert delta01 > 1e-3  # two different policies generated the two chunks

    # the loss: one pass, at sample index N = 2, which is neither chunk's weights
    assert len(loss_weights) == 1
    for g, w in zip(loss_weights[0], expected_sample(m0, seed=3, sample_index=2)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    for c in range(2):
        assert (flat(loss_weights[0]) - flat(pushed[c][n] for n in names)).abs().max() > 1e-3

    # m was back in place (bit for bit) when IVON stepped, and afterwards the module holds IVON's new mean
    assert len(before_step) == 1 and all(torch.equal(a, b) for a, b in zip(before_step[0], m0))
    optimizer = trainer.optimizers[0]
    group = optimizer.param_groups[0]
    lr = group["lr"] * (group["hess_init"] + group["weight_decay"])  # rescale_lr
    step = torch.clip((group["momentum"] / (1 - group["beta1"]) + DELTA * flat(m0)) / (group["hess"] + DELTA),
                      min=-CLIP, max=CLIP)
    assert torch.equal(flat(module.policy.parameters()), flat(m0) - lr * step)
    assert not torch.equal(flat(module.policy.parameters()), flat(m0))
    assert torch.equal(flat(module.engine.model.parameters()), flat(module.policy.parameters()))  # synced mean


def test_generate_mean_keeps_the_mean_in_the_engine_and_takes_c3pos_update(monkeypatch, tmp_path):
    """The ablation `generate=mean`: no weight sample reaches the engine (only means are pushed), and
    the loss still runs once at the fresh sample N with IVON recording it, as in C3PO."""
    calls = []
    real = IVON.sampled_params

    def spy(self, sample_index=0, train=False):
        calls.append((sample_index, train))
        return real(self, sample_index, train)

    monkeypatch.setattr(IVON, "sampled_params", spy)
    module = make_module(seed=3)
    pushed = spy_engine_pushes(module, monkeypatch)
    m0 = flat(module.policy.parameters())
    fit(module, ParamNoise("c3po", num_samples=2, generate="mean"), steps=2, log_dir=tmp_path)
    assert calls == [(2, True), (2, True)]  # no generating sample; the loss at θ̂_N, recorded for IVON's step
    names = [n for n, _ in module.policy.named_parameters()]
    assert len(pushed) == 3  # the mean before the first rollout, then the new mean after each step: no sample
    assert (flat(pushed[0][n] for n in names) - m0).abs().max() == 0
    assert (flat(pushed[-1][n] for n in names) - flat(module.policy.parameters())).abs().max() == 0
    assert (flat(module.policy.parameters()) - m0).abs().max() > 0  # IVON stepped
    rows = [r for r in csv.DictReader((tmp_path / "metrics.csv").open()) if r.get("reward/mean")]
    assert [math.isfinite(float(r["noise/relative"])) and float(r["noise/relative"]) > 0 for r in rows] == [True] * 2


@pytest.mark.parametrize("variant", ["b3po", "m3po"])
def test_generate_mean_is_c3pos_only(variant):
    with pytest.raises(ValueError, match="generate='mean' with variant="):
        ParamNoise(variant, generate="mean")
    with pytest.raises(ValueError, match="generate='both'"):
        ParamNoise("c3po", generate="both")


# -- config errors before any work -----------------------------------------------------------------------------
IVON_RUN = {"optimizer": "ivon", "ppo_epochs": 1, "mini_batches": 1, "seq_mask_tau": 2.0}


def test_group_size_not_divisible_fails_before_the_model_loads_naming_both_keys():
    """train.py passes the algorithm options to the callbacks right after building them (check_rl_callbacks)."""
    with pytest.raises(ValueError, match=r"algorithm\.group_size=8.*algorithm\.callbacks\.param_noise\.num_samples=3"):
        check_rl_callbacks([ParamNoise("c3po", num_samples=3)], AlgorithmConfig(**IVON_RUN, group_size=8))


def test_m3po_with_one_completion_per_sample_fails_before_the_model_loads_naming_both_keys():
    """G/N = 1: each chunk's advantage is r − r = 0, so M3PO would learn nothing; G/N = 2 is the smallest that can."""
    with pytest.raises(ValueError, match=r"algorithm\.group_size=4.*algorithm\.callbacks\.param_noise\.num_samples=4"
                                         r".*advantage"):
        check_rl_callbacks([ParamNoise("m3po", num_samples=4)], AlgorithmConfig(**IVON_RUN, group_size=4))
    check_rl_callbacks([ParamNoise("m3po", num_samples=4)], AlgorithmConfig(**IVON_RUN, group_size=8))  # G/N = 2
    check_rl_callbacks([ParamNoise("c3po", num_samples=4)], AlgorithmConfig(**IVON_RUN, group_size=4))  # C3PO pools


def test_train_py_refuses_a_group_size_not_divisible_before_the_model_loads(tmp_path):
    env = {**os.environ, "LIT_RLVR_CACHE": str(tmp_path / "empty-cache")}  # a model load would start a warm-up
    proc = subprocess.run([sys.executable, "train.py", "algorithm=c3po", "algorithm.group_size=6",
                           f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "algorithm.group_size=6" in proc.stderr and "num_samples=4" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "empty-cache").exists()  # no warm-up started: the model was never built


def test_m3po_with_one_completion_per_sample_fails_at_setup_before_any_rollout():
    """Built without `group_size` (a hand-written callback): setup checks the module's G."""
    module = make_module(group_size=4)
    with pytest.raises(ValueError, match=r"algorithm\.group_size=4.*algorithm\.callbacks\.param_noise\.num_samples=4"):
        fit(module, ParamNoise("m3po", num_samples=4), steps=1)
    assert module.engine is None and module.counters["rollouts_total"] == 0


@pytest.mark.parametrize("overrides, message", [
    (dict(group_size=6), r"algorithm\.group_size=6.*algorithm\.callbacks\.param_noise\.num_samples=4"),
    (dict(optimizer="adamw", grad_clip=1.0, optimizer_options=None), r"algorithm\.optimizer=ivon"),
])
def test_setup_fails_before_any_rollout(overrides, message):
    module = make_module(**overrides)
    with pytest.raises(ValueError, match=message):
        fit(module, ParamNoise("c3po", num_samples=4), steps=1)
    assert module.engine is None and module.counters["rollouts_total"] == 0  # no engine built, nothing generated


@pytest.mark.parametrize("overrides, message", [
    (dict(dtype="bfloat16"), r"model\.dtype=float32 \(got 'bfloat16'\)"),
    (dict(optimizer_options={**IVON_OPTIONS, "mc_samples": 2}), r"optimizer_options\.mc_samples=2"),
    (dict(optimizer_options={**IVON_OPTIONS, "ess": 0.0}), r"optimizer_options\.ess and algorithm\.lr must be > 0"),
    (dict(optimizer_options={**IVON_OPTIONS, "hess_approx": "fisher"}), r"optimizer_options\.hess_approx='fisher'"),
])
def test_ivon_options_that_cannot_work_fail_at_construction(overrides, message):
    """Half-precision weights would round IVON's updates away; mc_samples would be ignored (no closure)."""
    with pytest.raises(ValueError, match=message):
        make_module(**overrides)


@pytest.mark.parametrize("kwargs", [dict(variant="c4po"), dict(variant="b3po", num_samples=2)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="algorithm.callbacks.param_noise"):
        ParamNoise(**kwargs)


# -- M3PO advantages -------------------------------------------------------------------------------------------
def test_m3po_advantages_within_each_chunk():
    # one prompt, G = 4 from M = 2 samples: chunk 0 rewards (+1, −1), chunk 1 (+1, +1)
    rollouts = Rollouts(prompt_ids=torch.zeros(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1, dtype=torch.bool),
                        response_ids=torch.zeros(4, 1, dtype=torch.long), response_mask=torch.ones(4, 1,
                                                                                                   dtype=torch.bool),
                        old_logp=torch.zeros(4, 1), group=torch.zeros(4, dtype=torch.long),
                        source=torch.tensor([0, 0, 1, 1]), num_groups=1, prompts=["p"], answers=["a"],
                        rewards=torch.tensor([1.0, -1.0, 1.0, 1.0]))
    logged = {}
    stub = SimpleNamespace(log_metrics=logged.update, algorithm=AlgorithmConfig())  # grpo.yaml's
    ParamNoise("m3po", num_samples=2).on_before_advantages(None, stub, rollouts)
    adv, metrics = GRPOModule.compute_advantages(stub, rollouts)
    # within chunk 0: mean 0, std √2 -> ±1/√2; chunk 1 is constant -> 0 (pooled would give −√3, +1/√3, …)
    torch.testing.assert_close(adv, torch.tensor([2 ** -0.5, -(2 ** -0.5), 0.0, 0.0]), atol=1e-5, rtol=0)
    assert float(metrics["groups/zero_adv_frac"]) == 0.5  # one of the two (prompt, chunk) groups has no signal
    assert rollouts.loss_pass.tolist() == [0, 0, 1, 1]
    assert float(logged["groups/partial_chunk_frac"]) == 0.0  # both chunks have a success: not partial
    c3po = ParamNoise("c3po", num_samples=2)
    rollouts.adv_group = rollouts.loss_pass = None
    c3po.on_before_advantages(None, stub, rollouts)
    assert rollouts.adv_group is None  # C3PO pools the G


def test_partial_chunk_success_hand_worked():
    success = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0]).bool()
    group = torch.arange(4).repeat_interleave(4)
    chunk = torch.tensor([0, 0, 1, 1] * 4)
    partial, metrics = F.partial_chunk_success(success, group, chunk, 4, 2)
    # prompt 0, 1: successes only in chunk 0; prompt 2: none; prompt 3: in both chunks
    assert partial.tolist() == [True, True, False, False]
    assert float(metrics["groups/partial_chunk_frac"]) == pytest.approx(2 / 3)


# -- the three variants end to end -----------------------------------------------------------------------------
EXPECTED_SAMPLES = {  # per step: (sample index, train) of every sampled_params call, in order
    "b3po": [(0, False), (0, True)],
    "m3po": [(0, False), (1, False), (0, True), (1, True)],
    "c3po": [(0, False), (1, False), (2, True)],
}


@pytest.mark.parametrize("variant", ["b3po", "m3po", "c3po"])
def test_variant_runs_two_steps_with_finite_metrics(variant, tmp_path, monkeypatch):
    calls = []
    real = IVON.sampled_params

    def spy(self, sample_index=0, train=False):
        # with train=True the gradient must be empty: each sample's gradient is recorded once
        zeroed = all(p.grad is None for g in self.param_groups for p in g["params"]) if train else None
        calls.append((sample_index, train, zeroed))
        return real(self, sample_index, train)

    monkeypatch.setattr(IVON, "sampled_params", spy)
    module = make_module()
    pushed = spy_engine_pushes(module, monkeypatch)
    m0 = flat(module.policy.parameters())
    fit(module, ParamNoise(variant, num_samples=None if variant == "b3po" else 2), steps=2, log_dir=tmp_path)

    assert [(i, t) for i, t, _ in calls] == EXPECTED_SAMPLES[variant] * 2
    assert all(z for _, t, z in calls if t)
    # per step: one push per generating sample (also B3PO's single one), then the new mean
    sources = 1 if variant == "b3po" else 2
    assert len(pushed) == 2 * (sources + 1)
    names = [n for n, _ in module.policy.named_parameters()]
    assert (flat(pushed[0][n] for n in names) - m0).abs().max() > 1e-3  # the engine generated from a sample
    rows = [r for r in csv.DictReader((tmp_path / "metrics.csv").open()) if r.get("reward/mean")]
    assert len(rows) == 2
    keys = ["noise/sigma_mean", "noise/param_delta_rms", "groups/zero_adv_frac", "groups/partial_chunk_frac",
            "reward/malformed_frac", "loss/seq_mask_frac", "loss/policy", "grad/norm"]
    for row in rows:
        for key in keys:
            assert math.isfinite(float(row[key])), (key, row[key])
    sigma = 1.0 / math.sqrt(ESS * (H0 + DELTA))
    assert float(rows[0]["noise/sigma_mean"]) == pytest.approx(sigma, rel=0.05)
    assert float(rows[0]["noise/param_delta_rms"]) == pytest.approx(sigma, rel=0.05)


def test_bf16_engine_warns_once_when_sigma_below_spacing(caplog):
    policy = torch.nn.Linear(64, 64).to(torch.bfloat16)
    with torch.no_grad():
        policy.weight.fill_(0.03)
    optimizer = IVON(policy.parameters(), lr=1.0, ess=1e12, hess_init=1e-3)  # σ ≈ 3e-5 < spacing(0.03) ≈ 1.2e-4
    stub = SimpleNamespace(engine=None, policy=policy)
    callback = ParamNoise("c3po")
    with caplog.at_level("WARNING", logger="lit_rlvr.callbacks.param_noise"):
        callback._maybe_warn_bf16(stub, optimizer)
        callback._maybe_warn_bf16(stub, optimizer)
    assert len([r for r in caplog.records if "bf16 spacing" in r.getMessage()]) == 1
    fp32 = SimpleNamespace(engine=None, policy=torch.nn.Linear(4, 4))
    ParamNoise("c3po")._maybe_warn_bf16(fp32, IVON(fp32.policy.parameters(), lr=1.0, ess=1e12))
    assert len([r for r in caplog.records if "bf16 spacing" in r.getMessage()]) == 1  # fp32 engine: silent


# -- the recipe --------------------------------------------------------------------------------------------------
def test_train_py_c3po_writes_run_outputs(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "LIT_RLVR_CACHE": CACHE}
    cmd = [sys.executable, "train.py", "algorithm=c3po", "trainer.max_steps=2", "eval_before=false",
           f"hydra.run.dir={run_dir}", "data.num_test=16", "callbacks.progress=null"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert any(r.get("noise/sigma_mean") for r in rows) and any(r.get("loss/seq_mask_frac") for r in rows)
    assert (run_dir / "summary.json").exists() and (run_dir / "checkpoints" / "last.ckpt").exists()


# -- options, hooks and edges (found by mutation testing: scripts/mutation.py) ---------------------------------------
def test_every_documented_option_is_checked_at_its_boundary():
    assert ParamNoise("b3po").num_samples == 1 and ParamNoise("m3po").num_samples == 4
    assert ParamNoise("c3po", num_samples="2").num_samples == 2  # from a YAML string
    assert ParamNoise("c3po", bf16_check_every=1).bf16_check_every == 1
    for kwargs, key in ((dict(num_samples=0), "num_samples=0"), (dict(bf16_check_every=0), "bf16_check_every=0"),
                        (dict(variant="b3po", num_samples=0), "num_samples=0")):
        with pytest.raises(ValueError, match=rf"algorithm\.callbacks\.param_noise\.{key}"):
            ParamNoise(**kwargs)
    ParamNoise("c3po", num_samples=1).check_algorithm(AlgorithmConfig(**
        dict(optimizer="ivon", group_size=1, seq_mask_tau=2.0)))  # N = 1 divides every G


def _chunked(rewards: list[float], source: list[int]) -> Rollouts:
    n = len(rewards)
    return Rollouts(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
                    response_ids=torch.zeros(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1, dtype=torch.bool),
                    old_logp=torch.zeros(n, 1), group=torch.zeros(n, dtype=torch.long), source=torch.tensor(source),
                    num_groups=1, prompts=["p"], answers=["a"], rewards=torch.tensor(rewards))


def test_partial_chunk_metric_with_positive_only_rewards():
    """Rewards in {0, 1}: a success is a reward > 0, so a 0 is a failure (not a success, as `>= 0` would read it).
    Chunk 0 has the only success: the group is partial."""
    logged = {}
    stub = SimpleNamespace(log_metrics=logged.update)
    ParamNoise("c3po", num_samples=2).on_before_advantages(None, stub, _chunked([1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1]))
    assert float(logged["groups/partial_chunk_frac"]) == 1.0
    ParamNoise("c3po", num_samples=2).on_before_advantages(None, stub, _chunked([0.0, 0.0, 0.0, 0.0], [0, 0, 1, 1]))
    assert float(logged["groups/partial_chunk_frac"]) == 0.0  # no success at all: nothing to call partial


def _ivon_trainer(seed: int = 3):
    torch.manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(3, 2))
    opt = IVON([weight], lr=0.1, ess=1e3, hess_init=0.1, seed=seed)
    return SimpleNamespace(optimizers=[opt]), opt, weight


def test_plan_sources_contexts_and_stacks_are_ivon_samples():
    trainer, opt, weight = _ivon_trainer()
    mean = weight.detach().clone()
    plan = RolloutPlan(["a"], [0], [[1]], [4])
    ParamNoise("c3po", num_samples=2).on_rollout_plan(trainer, None, plan)
    assert plan.num_weight_sources == 2 and not plan.uses_mean_weights
    stacks = plan.weight_stacks(2)[weight]  # [2, 3, 2]
    for source in (0, 1):
        with plan.weight_context(source):
            theta = weight.detach().clone()
        gen = torch.Generator().manual_seed(sample_seed(3, 0, source, 0, 0))
        torch.testing.assert_close(theta, mean + opt.sigma()[0] * torch.randn(6, generator=gen).view(3, 2))
        assert torch.equal(stacks[source], theta)
    assert torch.equal(weight.detach(), mean)
    with pytest.raises(RuntimeError, match="weight sources"):
        ParamNoise("c3po", num_samples=2).on_rollout_plan(trainer, None, plan)
    with pytest.raises(TypeError, match="exactly one optimizer"):
        ParamNoise("c3po")._ivon(SimpleNamespace(optimizers=[opt, opt]))


@pytest.mark.parametrize("variant, loss_pass, index", [("c3po", 0, 2), ("m3po", 1, 1), ("b3po", 0, 0)])
def test_loss_context_holds_the_right_sample_and_records_its_gradient(variant, loss_pass, index):
    """C3PO's loss sample is a fresh index N (never a generating one); M3PO's and B3PO's is the pass's own."""
    trainer, opt, weight = _ivon_trainer()
    mean = weight.detach().clone()
    callback = ParamNoise(variant, num_samples=1 if variant == "b3po" else 2)
    weight.grad = torch.ones_like(weight)  # stale: the context clears it first
    with callback.loss_context(trainer, None, None, loss_pass):
        assert weight.grad is None
        theta = weight.detach().clone()
        (weight * 2).sum().backward()
    gen = torch.Generator().manual_seed(sample_seed(3, 0, index, 0, 0))
    torch.testing.assert_close(theta, mean + opt.sigma()[0] * torch.randn(6, generator=gen).view(3, 2))
    assert opt.state["count"] == 1 and torch.equal(opt.state["avg_grad"], torch.full((6,), 2.0))


def test_option_checks_and_bf16_check_cadence(monkeypatch, caplog):
    options = dict(optimizer="ivon", group_size=4, ppo_epochs=1, mini_batches=1, seq_mask_tau=2.0)
    callback = ParamNoise("c3po", num_samples=2)
    callback.check_algorithm(AlgorithmConfig(**options))
    assert "without the sequence importance mask" not in caplog.text
    callback.check_algorithm(AlgorithmConfig(**dict(options, seq_mask_tau=None)))
    assert "without the sequence importance mask" in caplog.text
    for epochs, minis in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match="algorithm.ppo_epochs=1 and algorithm.mini_batches=1"):
            callback.check_algorithm(AlgorithmConfig(**dict(options, ppo_epochs=epochs, mini_batches=minis)))
    trainer, opt, _ = _ivon_trainer()
    checked = []
    monkeypatch.setattr(ParamNoise, "_maybe_warn_bf16", lambda self, module, optimizer: checked.append(module.step))
    callback = ParamNoise("c3po", num_samples=2, bf16_check_every=3)
    for step in range(7):
        logged = {}
        callback.on_rl_step_end(trainer, SimpleNamespace(global_step=step, step=step, log_metrics=logged.update),
                                None)
        assert set(logged) == {"noise/sigma_mean", "noise/param_delta_rms", "noise/relative", "noise/numel"}
    assert checked == [0, 3, 6]


def test_engine_dtype_prefers_the_engines_own():
    policy = torch.nn.Linear(2, 2)
    from lit_rlvr.callbacks.param_noise import engine_dtype

    assert engine_dtype(SimpleNamespace(engine=None, policy=policy)) == torch.float32
    silent = SimpleNamespace(generation_dtype=lambda: None)
    assert engine_dtype(SimpleNamespace(engine=silent, policy=policy)) == torch.float32
    bf16 = SimpleNamespace(generation_dtype=lambda: torch.bfloat16)
    assert engine_dtype(SimpleNamespace(engine=bf16, policy=policy)) == torch.bfloat16
