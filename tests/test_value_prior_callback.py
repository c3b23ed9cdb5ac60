"""V0.5 callback (`lit_rlvr.callbacks.ValuePrior`): Eq. 8 baseline, OSLA rounds, absent prior, Trainer runs, state."""

import csv
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.callbacks import ValuePrior
from lit_rlvr.data.datamodule import collate
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.module import GRPOModule
from lit_rlvr.rewards.base import RewardResult, RewardRunner
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from tiny_options import TINY as TINY_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
TINY = TINY_OPTIONS  # conf/model/tiny.yaml: reuses its cache
V05_KEYS = ("v05/w_mean", "v05/prior_rejected_frac", "v05/rollouts_per_prompt", "v05/rounds", "v05/prior_auc",
            "v05/prior_abs_err", "v05/context_size", "v05/prior_present", "time/prior_s")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The warm-started tiny model's cache: $LIT_RLVR_CACHE when set (shared, fast), else a fresh tmp dir."""
    return os.environ.get("LIT_RLVR_CACHE") or str(tmp_path_factory.mktemp("cache"))


class StubV0:
    """A value model with known predictions: p̂ by prompt text (default for others); records its calls."""

    def __init__(self, p_hat: dict, default: float = 0.5):
        self.p_hat, self.default, self.calls = p_hat, default, 0

    def predict(self, prompts, context):
        self.calls += 1
        return torch.tensor([self.p_hat.get(p, self.default) for p in prompts]), {}


class MetricSink:
    """Stands in for the module in hook calls: collects what the callback logs."""

    def __init__(self):
        self.metrics = {}

    def log_metrics(self, metrics):
        self.metrics.update({k: float(v) for k, v in metrics.items()})


def plan_for(prompts):
    return RolloutPlan(list(prompts), [0] * len(prompts), [[1]] * len(prompts), [8] * len(prompts))


def fake_rollouts(prompts, rewards):
    """Rollouts of len(prompts) groups with the given per-prompt reward lists (one token per response)."""
    flat = [r for per in rewards for r in per]
    group = torch.tensor([b for b, per in enumerate(rewards) for _ in per])
    n = len(flat)
    return Rollouts(
        prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
        response_ids=torch.ones(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1, dtype=torch.bool),
        old_logp=torch.zeros(n, 1), group=group, source=torch.zeros(n, dtype=torch.long),
        num_groups=len(prompts), prompts=list(prompts), answers=[0] * len(prompts),
        rewards=torch.tensor(flat, dtype=torch.float32), malformed=torch.zeros(n, dtype=torch.bool),
    )


def ready_callback(p_hat: dict, **kwargs) -> ValuePrior:
    """A ValuePrior whose context is already past min_context, with a stub V0."""
    cb = ValuePrior(value_model=StubV0(p_hat), min_context=1, context_size=8, **{"k_init": 4, **kwargs})
    cb.context.add(["old"], [0.5], [4])
    return cb


# ----------------------------------------------------------------------------------------------- Eq. 8 baseline


def test_baseline_is_eq8_and_advantages_are_r_minus_b():
    # σ² = 1.  a: V = 2·0.5−1 = 0, v̄ = 0.5, k = 4: (0.5)² = 0.25 ≤ 1/4 → Δ̂² = 0, b = V = 0
    #          b: V = 0.8, v̄ = −1, k = 4: Δ̂² = 3.24 − 0.25 = 2.99, w = 2.99/3.24 = 0.922840,
    #             b = 0.922840·(−1) + 0.077160·0.8 = −0.861111
    #          c: V = −0.5, v̄ = 0, k = 2: 0.25 − 0.5 < 0 → Δ̂² = 0, b = V = −0.5
    prompts = ["a", "b", "c"]
    cb = ready_callback({"a": 0.5, "b": 0.9, "c": 0.25})
    plan = plan_for(prompts)
    cb.on_rollout_plan(None, None, plan)
    assert plan.n_per_prompt == [4, 4, 4] and plan.budget_rule is not None  # k_init, not the module's 8
    rollouts = fake_rollouts(prompts, [[1, 1, 1, -1], [-1, -1, -1, -1], [1, -1]])
    cb.on_before_advantages(None, None, rollouts)
    torch.testing.assert_close(rollouts.baseline, torch.tensor([0.0, -0.861111, -0.5]), atol=1e-5, rtol=0)
    module = types.SimpleNamespace(algorithm=AlgorithmConfig(scale_adv_by_std=False))  # v05.yaml's
    adv, _ = GRPOModule.compute_advantages(module, rollouts)
    expected = rollouts.rewards - rollouts.baseline[rollouts.group]
    torch.testing.assert_close(adv, expected)

    sink = MetricSink()
    cb.on_rl_step_end(None, sink, rollouts)
    m = sink.metrics
    assert set(V05_KEYS) <= set(m)
    assert m["v05/prior_present"] == 1.0 and m["v05/context_size"] == 1.0
    assert m["v05/w_mean"] == pytest.approx(0.922840 / 3, abs=1e-5)
    assert m["v05/prior_rejected_frac"] == pytest.approx(1 / 3)
    assert m["v05/rollouts_per_prompt"] == pytest.approx(10 / 3)
    assert m["v05/prior_abs_err"] == pytest.approx((0.25 + 0.9 + 0.25) / 3, abs=1e-6)
    # per-sample AUC of p̂ vs r > 0: positives 3×0.5, 1×0.25; negatives 1×0.5, 4×0.9, 1×0.25 → 5/24
    assert m["v05/prior_auc"] == pytest.approx(5 / 24, abs=1e-6)
    assert m["time/prior_s"] >= 0
    # the step's records joined the context: success rate (r̄ + 1)/2 and n
    state = cb.context.state_dict()
    assert state["prompts"] == ["old", "a", "b", "c"]
    assert state["success_rate"] == [0.5, 0.75, 0.0, 0.5] and state["counts"] == [4, 4, 4, 2]


def test_reward_range_option():
    # rewards in {0, 1}: V = p̂, σ² = (1 − 0)²/4 = 0.25; v̄ = 0.25 (k = 4), V = 0.9: Δ̂² = 0.4225 − 0.0625 = 0.36,
    # w = 0.36 / 0.4225 = 0.852071, b = 0.852071·0.25 + 0.147929·0.9 = 0.346154
    cb = ready_callback({"a": 0.9}, reward_range=(0.0, 1.0))
    assert cb.noise_var == 0.25
    cb.on_rollout_plan(None, None, plan_for(["a"]))
    rollouts = fake_rollouts(["a"], [[1, 0, 0, 0]])
    cb.on_before_advantages(None, None, rollouts)
    torch.testing.assert_close(rollouts.baseline, torch.tensor([0.346154]), atol=1e-5, rtol=0)
    cb.on_rl_step_end(None, MetricSink(), rollouts)
    assert cb.context.state_dict()["success_rate"][-1] == 0.25


# ----------------------------------------------------------------------------------------------- OSLA rounds


def simulate(cb: ValuePrior, prompts, outcome):
    """Drive the plan's budget rule as the module does, with rewards `outcome(prompt, i)`; returns counts, rounds."""
    plan = plan_for(prompts)
    cb.on_rollout_plan(None, None, plan)
    rewards = [[] for _ in prompts]
    counts = plan.n_per_prompt
    while counts is not None:
        assert all(c >= 0 for c in counts)
        for b, c in enumerate(counts):
            rewards[b] += [outcome(prompts[b], len(rewards[b]) + i) for i in range(c)]
        counts = plan.budget_rule(fake_rollouts(prompts, rewards))
    rollouts = fake_rollouts(prompts, rewards)
    cb.on_before_advantages(None, None, rollouts)
    sink = MetricSink()
    cb.on_rl_step_end(None, sink, rollouts)
    return [len(r) for r in rewards], sink.metrics


def always(success: set):
    return lambda prompt, i: 1.0 if prompt in success else -1.0


def test_osla_spends_on_prompts_whose_prior_is_wrong_up_to_k_max():
    prompts = [f"p{i}" for i in range(8)]
    # prior says every prompt is easy (p̂ = 0.95, V = 0.9); p0 and p1 always fail: prior wrong there
    succeed = set(prompts[2:])
    cb = ready_callback({p: 0.95 for p in prompts}, pad_to=1)
    counts, m = simulate(cb, prompts, always(succeed))
    # right prior: (1 − 0.9)² < 1/4 → Δ̂² = 0 → no gain, stop at k_init. Wrong prior: gain ≈ 1/(k(k+1)) > c
    # up to k = 15, so 16 = k_max; 2 of 8 asking = 25% = min_active_frac, rounds continue
    assert counts == [16, 16, 4, 4, 4, 4, 4, 4]
    assert m["v05/rounds"] == 13  # rounds at k = 4, 5, ..., 16 (the last one says stop)
    assert m["v05/prior_rejected_frac"] == pytest.approx(0.25)
    cb_low = ready_callback({p: 0.95 for p in prompts}, pad_to=1, k_max=7)
    assert simulate(cb_low, prompts, always(succeed))[0] == [7, 7, 4, 4, 4, 4, 4, 4]


def test_osla_batch_rules_min_active_frac_and_padding():
    prompts = [f"p{i}" for i in range(8)]
    easy = {p: 0.95 for p in prompts}
    # one wrong prompt of 8 (12.5% < 25%): no extra round at all
    counts, m = simulate(ready_callback(easy, pad_to=1), prompts, always(set(prompts[1:])))
    assert counts == [4] * 8 and m["v05/rounds"] == 1
    # pad_to = 8: each extra round is a multiple of 8 sequences; the padding never pushes a prompt past k_max
    counts, _ = simulate(ready_callback(easy, pad_to=8, k_max=12), prompts, always(set(prompts[2:])))
    assert max(counts) <= 12 and (sum(counts) - 32) % 8 == 0 and counts[0] == counts[1] == 12


def test_noisy_outcomes_near_the_prior_stop_early():
    # p̂ = 0.5 (V = 0) and outcomes alternating ±1: v̄ = 0 = V, never rejected, nobody asks for more
    prompts = ["x", "y", "z", "w"]
    counts, m = simulate(ready_callback({}, pad_to=1), prompts, lambda p, i: 1.0 if i % 2 else -1.0)
    assert counts == [4, 4, 4, 4] and m["v05/w_mean"] == 0.0


# ----------------------------------------------------------------------------------------------- absent prior


def test_prior_absent_below_min_context_gives_the_sample_mean():
    stub = StubV0({"a": 0.99, "b": 0.99})
    cb = ValuePrior(value_model=stub, min_context=4, pad_to=1, k_init=4)
    prompts = ["a", "b"]
    plan = plan_for(prompts)
    cb.on_rollout_plan(None, None, plan)
    assert stub.calls == 0  # below min_context V0 is not even asked
    rollouts = fake_rollouts(prompts, [[1, -1, -1, -1], [-1, -1, -1, -1]])
    cb.on_before_advantages(None, None, rollouts)
    torch.testing.assert_close(rollouts.baseline, torch.tensor([-0.5, -1.0]))  # plain sample means
    sink = MetricSink()
    cb.on_rl_step_end(None, sink, rollouts)
    m = sink.metrics
    assert m["v05/prior_present"] == 0.0 and m["v05/w_mean"] == 1.0 and m["v05/context_size"] == 0.0
    assert all(math.isnan(m[k]) for k in ("v05/prior_auc", "v05/prior_abs_err", "v05/prior_rejected_frac"))
    # without a prior OSLA prices samples as for the plain mean: 1/(k(k+1)) > c up to k = 15
    counts, m = simulate(cb, ["c", "d"], always(set()))
    assert counts == [16, 16] and m["v05/prior_present"] == 0.0 and stub.calls == 0
    # 4 records now: the prior is present from the next step on
    counts, m = simulate(cb, ["a", "b"], always({"a", "b"}))
    assert stub.calls == 1 and m["v05/prior_present"] == 1.0 and counts == [4, 4]


# ----------------------------------------------------------------------------------------------- config and state


def test_config_errors_name_the_keys():
    with pytest.raises(ValueError, match=r"algorithm\.callbacks\.value_prior\.k_init=17.*"
                                         r"algorithm\.callbacks\.value_prior\.k_max=16"):
        ValuePrior(k_init=17, k_max=16)
    with pytest.raises(ValueError, match=r"value_prior\.min_context"):
        ValuePrior(min_context=300, context_size=256)
    with pytest.raises(ValueError, match=r"value_prior\.head='nope'.*kernel"):
        ValuePrior(head="nope")
    with pytest.raises(ValueError, match=r"value_prior\.reward_range"):
        ValuePrior(reward_range=(1.0, -1.0))
    with pytest.raises(ValueError, match=r"value_prior\.min_active_frac"):
        ValuePrior(min_active_frac=1.5)


def test_state_round_trip_keeps_context_and_cache_keys(tmp_path):
    cb = ValuePrior(value_model=StubV0({}), context_size=4, min_context=2)
    cb.context.add(["a", "b", "c"], [0.25, 1.0, 0.0], [4, 8, 16])
    cb.value_model.backbone = types.SimpleNamespace(state_dict=lambda: {"cached_prompts": ["a", "b", "c", "z"]})
    torch.save({"callbacks": {"ValuePrior": cb.state_dict()}}, tmp_path / "ckpt")  # as Lightning stores it
    state = torch.load(tmp_path / "ckpt", weights_only=False)["callbacks"]["ValuePrior"]
    fresh = ValuePrior(value_model=StubV0({}), context_size=4, min_context=2)
    fresh.load_state_dict(state)
    assert fresh.context.state_dict() == cb.context.state_dict() and fresh.context.is_ready
    assert fresh.state_dict() == cb.state_dict()  # the cache keys survive until the backbone refills
    assert state["embedding_cache_keys"] == ["a", "b", "c", "z"]



def test_multi_rank_checkpoint_resumed_on_one_rank_takes_every_ranks_records():
    """A 2-rank checkpoint holds each rank's state (tests/test_fsdp.py resumes it on 2 ranks, exactly); on 1 rank
    the records of both are joined in rank order and the newest context_size kept, the cache keys and features
    united, and the head's saved search dropped."""
    ranks = []
    for prompts, rates in ((["a", "b"], [0.25, 1.0]), (["c", "d", "e"], [0.0, 0.5, 0.75])):
        cb = ValuePrior(value_model=StubV0({}), context_size=4, min_context=2)
        cb.context.add(prompts, rates, [4] * len(prompts))
        ranks.append({**cb.state_dict(), "embedding_cache_keys": prompts,
                      "context_features": {p: torch.full((2,), float(i)) for i, p in enumerate(prompts)},
                      "head_state": {"searched_at": 3, "geometry": "rank's own"}})
    fresh = ValuePrior(value_model=StubV0({}), context_size=4, min_context=2)
    fresh.load_state_dict({"ranks": ranks})
    context = fresh.context.state_dict()
    assert context["prompts"] == ["b", "c", "d", "e"] and context["success_rate"] == [1.0, 0.0, 0.5, 0.75]
    assert context["total_added"] == 5
    assert fresh._restored_cache_keys == ["a", "b", "c", "d", "e"]
    assert sorted(fresh._restored_features) == ["a", "b", "c", "d", "e"]
    assert fresh._restored_head == {}


# ----------------------------------------------------------------------------------------------- with the tiny model


class Spy(RLVRCallback):
    """Records each step's per-prompt sample counts and the module's logged metrics."""

    def __init__(self):
        self.counts, self.metrics = [], []

    def on_before_advantages(self, trainer, pl_module, rollouts):
        self.counts.append(dict(zip(rollouts.prompts, rollouts.group_sizes().tolist())))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in pl_module.step_metrics.items()})


def fit(module, callbacks, loader, steps, **kwargs):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=callbacks, **kwargs)
    trainer.fit(module, train_dataloaders=loader)
    return trainer


def test_end_to_end_step_wrong_prior_gets_more_samples(cache_dir):
    records = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(8)]
    prompts = [r["prompt"] for r in records]
    succeed = set(prompts[:5])  # the reward ignores the completion: known outcomes per prompt
    module = GRPOModule(model="tiny", model_options={"cache_dir": cache_dir, **TINY}, group_size=4, lr=1e-4,
                        scale_adv_by_std=False)  # k_init follows group_size
    module.reward_runner = RewardRunner(lambda p, c, a: RewardResult(1.0 if p in succeed else -1.0, False))
    # V0 is right about p0..p4 (easy) and p5 (hard), wrong about p6, p7 (says easy, they always fail)
    stub = StubV0({p: (0.05 if p == prompts[5] else 0.95) for p in prompts})
    cb = ValuePrior(value_model=stub, min_context=1, pad_to=1)
    cb.context.add(["seed"], [0.5], [4])
    spy = Spy()
    fit(module, [cb, spy], DataLoader(records, batch_size=8, collate_fn=collate), steps=1)
    counts = spy.counts[0]
    assert [counts[p] for p in prompts] == [4, 4, 4, 4, 4, 4, 16, 16]
    m = spy.metrics[0]
    assert m["v05/rounds"] == 13 and m["v05/prior_present"] == 1.0 and m["rollouts/per_step"] == 56
    assert m["v05/prior_rejected_frac"] == pytest.approx(0.25) and m["time/prior_s"] < m["time/step_s"]


def test_trainer_run_v05_config_on_tiny_model(cache_dir, tmp_path):
    """Three steps of `algorithm=v05` (composed from conf/, real MiniLM + kernel V0) with a Lightning Trainer."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lit_rlvr.app.recipe import build_module

    overrides = ["algorithm=v05", f"cache_dir={cache_dir}", "data.batch_size=8",
                 "algorithm.callbacks.value_prior.min_context=8", "algorithm.callbacks.value_prior.k_max=8",
                 "algorithm.callbacks.value_prior.pad_to=8"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    module = build_module(cfg)
    assert module.algorithm.group_size == 4 and module.algorithm.scale_adv_by_std is False
    cb = instantiate(cfg.algorithm.callbacks.value_prior)
    spy = Spy()
    trainer = fit(module, [cb, spy], instantiate(cfg.data), steps=3)
    rows = spy.metrics
    assert len(rows) == 3 and all(set(V05_KEYS) <= set(r) for r in rows)
    assert [r["v05/context_size"] for r in rows] == [0, 8, 16]
    assert [r["v05/prior_present"] for r in rows] == [0, 1, 1]
    assert all(4 <= r["v05/rollouts_per_prompt"] <= 8 for r in rows)
    assert all(math.isfinite(r["v05/prior_abs_err"]) for r in rows[1:])
    assert len(cb.context) == 24
    # Lightning saves the callback's state in the checkpoint; a fresh callback restores the context from it
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if "ValuePrior" in k]
    fresh = instantiate(cfg.algorithm.callbacks.value_prior)
    fresh.load_state_dict(state)
    assert fresh.context.state_dict() == cb.context.state_dict()
    assert set(cb.context.prompts) <= set(state["embedding_cache_keys"])


@pytest.mark.skipif(not (ROOT / "conf" / "algorithm" / "c3po.yaml").exists(), reason="needs the C3PO config")
def test_c3po_v05_spreads_osla_rounds_over_weight_samples(cache_dir):
    """`algorithm=c3po_v05`: OSLA's extra samples of a prompt are split evenly over C3PO's N weight samples."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lit_rlvr.app.recipe import build_module

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["algorithm=c3po_v05", f"cache_dir={cache_dir}",
                                           "algorithm.callbacks.value_prior.pad_to=1"])
    module = build_module(cfg)
    records = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(8)]
    prompts = [r["prompt"] for r in records]
    module.reward_runner = RewardRunner(lambda p, c, a: RewardResult(1.0 if p in prompts[:6] else -1.0, False))
    callbacks = [instantiate(node) for node in cfg.algorithm.callbacks.values()]
    (cb,) = [c for c in callbacks if isinstance(c, ValuePrior)]
    cb.value_model = StubV0({p: 0.95 for p in prompts})  # wrong about p6, p7
    cb.context.add(["seed"] * cb.context.min_context, [0.5] * cb.context.min_context, [4] * cb.context.min_context)
    chunks = []

    class ChunkSpy(RLVRCallback):
        def on_before_advantages(self, trainer, pl_module, rollouts):
            chunks.append(torch.stack([rollouts.group, rollouts.source], -1))  # [N, 2]

    fit(module, [*callbacks, ChunkSpy()], DataLoader(records, batch_size=8, collate_fn=collate), steps=1)
    table = torch.zeros(8, 4, dtype=torch.long).index_put_(tuple(chunks[0].T), torch.tensor(1), accumulate=True)
    assert table.sum(-1).tolist() == [4] * 6 + [16, 16]  # [B] samples per prompt
    assert table.tolist() == [[1, 1, 1, 1]] * 6 + [[4, 4, 4, 4]] * 2  # [B, N] per prompt and weight sample


# ----------------------------------------------------------------------------------------------- train.py


@pytest.mark.slow
def test_train_py_v05_writes_metrics_summary_checkpoint(cache_dir, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "LIT_RLVR_CACHE": cache_dir, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "train.py", "algorithm=v05", "trainer.max_steps=2", "eval_before=false",
           f"hydra.run.dir={run}", "callbacks.progress=null", "data.num_test=32",
           "algorithm.callbacks.value_prior.min_context=8", "algorithm.callbacks.value_prior.k_max=8"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    with (run / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("v05/prior_present")]
    assert len(rows) == 2 and set(V05_KEYS) <= set(rows[0])
    assert [float(r["v05/prior_present"]) for r in rows] == [0.0, 1.0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "v05" and summary["steps"] == 2
    assert (run / "checkpoints" / "last.ckpt").exists()


def test_osla_stops_at_the_same_count_on_any_reward_range():
    """The cost c is a price in ±1-scale MSE: rewards in {0, 1} (MSE a quarter as large) stop where ±1 do."""
    prompts = [f"p{i}" for i in range(8)]
    succeed = set(prompts[2:])
    plus_minus = simulate(ready_callback({p: 0.95 for p in prompts}, pad_to=1, k_max=32), prompts, always(succeed))
    zero_one = simulate(ready_callback({p: 0.95 for p in prompts}, pad_to=1, k_max=32, reward_range=(0.0, 1.0)),
                        prompts, lambda prompt, i: 1.0 if prompt in succeed else 0.0)
    assert zero_one[0] == plus_minus[0] and plus_minus[0][0] > 4  # the wrong-prior prompts got extra samples


def test_v0_is_built_on_the_strategys_device_not_where_the_module_still_is(monkeypatch):
    """Lightning calls `setup` before the strategy moves the module: device=None must mean the strategy's."""
    import lit_rlvr.value

    built = {}
    monkeypatch.setattr(lit_rlvr.value.ValueModel, "create", staticmethod(lambda **kw: built.update(kw) or StubV0({})))
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 3)))
    module = types.SimpleNamespace(device=torch.device("cpu"),
                                   algorithm=AlgorithmConfig(group_size=4, scale_adv_by_std=False))
    ValuePrior().setup(trainer, module, "fit")
    assert built["device"] == "cuda:3"


# ----------------------------------------------------------------------------------------------- options at their edges
V = r"algorithm\.callbacks\.value_prior\."


@pytest.mark.parametrize("kwargs, key", [
    (dict(k_init=0), "k_init"), (dict(cost=-0.001), "cost"), (dict(min_active_frac=-0.01), "min_active_frac"),
    (dict(min_active_frac=1.01), "min_active_frac"), (dict(pad_to=0), "pad_to"), (dict(round_size=0), "pad_to"),
    (dict(reward_range=(0.0, 0.0)), "reward_range"), (dict(reward_range=(0.0, 0.5, 1.0)), "reward_range"),
    (dict(noise_var=0.0), "noise_var"), (dict(min_context=0), "min_context"),
    (dict(min_context=9, context_size=8), "min_context"), (dict(features="nope"), "features"),
    (dict(precompute="sometimes"), "precompute"), (dict(precompute_max=0), "precompute_max"),
    (dict(precompute_batch=0), "precompute_max"), (dict(bandwidth_refit=-0.1), "bandwidth_refit"),
    (dict(bandwidth_refit=1.1), "bandwidth_refit"),
])
def test_each_option_out_of_range_names_its_key(kwargs, key):
    with pytest.raises(ValueError, match=V + key):
        ValuePrior(**kwargs)


def test_each_option_at_its_valid_boundary_is_accepted():
    """The edges of every range are valid values; a given value model skips the checks of V0's own options."""
    cb = ValuePrior(k_init=16, k_max=16, cost=0.0, min_active_frac=0.0, pad_to=1, round_size=1, min_context=8,
                    context_size=8, bandwidth_refit=0.0, precompute_max=1, precompute_batch=1, precompute="off")
    assert (cb.k_init, cb.k_max, cb.cost, cb.pad_to, cb.round_size) == (16, 16, 0.0, 1, 1)
    ValuePrior(min_active_frac=1.0, bandwidth_refit=1.0, min_context=1)
    ValuePrior(value_model=StubV0({}), head="nope", features="nope")  # V0's options are not used then
    # reward range (0, 1): σ² = ¼ (worst case (high − low)²/4), OSLA's price scales by ((high − low)/2)² = ¼
    cb = ValuePrior(reward_range=(0.0, 1.0), cost=0.004)
    assert cb.noise_var == 0.25 and cb._cost_f32 == pytest.approx(0.001)
    assert ValuePrior(reward_range=(0.0, 1.0), noise_var=0.5).noise_var == 0.5


def test_reward_scale_and_success_rate_maps():
    """p̂ → V = low + (high − low)·p̂ and back, clamped to [0, 1]: on (2, 6), p̂ = 0.25 → 3; mean 5 → 0.75."""
    cb = ValuePrior(reward_range=(2.0, 6.0))
    assert cb.to_reward_scale(torch.tensor([0.25, 1.0])).tolist() == [3.0, 6.0]
    assert cb.to_success_rate(torch.tensor([5.0, 7.0, 1.0])).tolist() == [0.75, 1.0, 0.0]
    assert cb._to_success_rate_py([5.0, 7.0, 1.0]) == [0.75, 1.0, 0.0]


class _Source:
    def __init__(self, size: int, batch_size: int, ordered: bool):
        self.size, self.batch_size = size, batch_size
        self.order = (lambda epoch: list(range(size))) if ordered else None

    def __len__(self):
        return self.size


@pytest.mark.parametrize("mode, size, max_steps, ordered, expected", [
    ("auto", 100, -1, True, "all"),  # the whole set fits precompute_max (100): all of it, once
    ("auto", 101, -1, True, "next"),  # one more than fits, order known: the coming steps' prompts
    ("auto", 101, -1, False, "off"),  # order unknown and too large: in the steps
    ("auto", 40, 5, True, "all"),  # the run draws 5 × 8 = 40 ≥ 40 prompts: all
    ("auto", 41, 5, True, "next"),  # it draws fewer than the set: only what it draws
    ("auto", 41, 5, False, "all"),  # ... but without an order, all (the set fits precompute_max)
    ("next", 41, 5, False, "off"),  # "next" needs the order
    ("next", 41, 5, True, "next"), ("all", 500, 5, False, "all"), ("off", 10, 5, True, "off"),
])
def test_precompute_mode_choice(mode, size, max_steps, ordered, expected):
    cb = ValuePrior(value_model=StubV0({}), precompute=mode, precompute_max=100)
    assert cb._resolve_precompute(_Source(size, 8, ordered), max_steps) == expected


def test_precompute_without_a_dataset_is_off():
    assert ValuePrior(value_model=StubV0({}))._resolve_precompute(None, 10) == "off"
    assert ValuePrior(value_model=StubV0({}), precompute="all")._resolve_precompute(None, 10) == "off"
