"""scripts/reproduce.py (issue 9) in a tiny mode, and the oracle baseline-MSE callback on hand-worked cases."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_rlvr.callbacks.dead_groups import DeadGroupProbe, any_correct, rescued_share
from lit_rlvr.callbacks.oracle_baseline import OracleBaseline, debiased_mse, group_moments
from lit_rlvr.optim import IVON
from lit_rlvr.rewards.base import RewardBatch
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from lit_rlvr.rollout.driver import RolloutDriver
from lit_rlvr.rollout.engine import Completion, RolloutEngine, SamplingConfig

ROOT = Path(__file__).resolve().parents[1]


# -- the MSE arithmetic --------------------------------------------------------------------------------------------
def test_debiased_mse_by_hand():
    # prompt 0: oracle rewards (+1, +1, −1, −1): mean 0, unbiased variance 4/3; baseline 0.5 → (0.5 − 0)² = 0.25
    # prompt 1: oracle rewards (+1, +1, +1, −1): mean 0.5, variance 1;        baseline −0.5 → (−1)² = 1
    rewards = torch.tensor([1.0, 1, -1, -1, 1, 1, 1, -1])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mean, var, count = group_moments(rewards, group, 2)
    assert mean.tolist() == [0.0, 0.5] and count.tolist() == [4, 4]
    assert var.tolist() == pytest.approx([4 / 3, 1.0])
    mse, parts = debiased_mse(torch.tensor([0.5, -0.5]), mean, var, count)
    assert float(parts["raw"]) == pytest.approx((0.25 + 1.0) / 2)
    assert float(parts["noise"]) == pytest.approx((4 / 3 / 4 + 1 / 4) / 2)  # s²/M per prompt, averaged
    assert float(mse) == pytest.approx(0.625 - 7 / 24)


def test_debiased_mse_is_unbiased():
    # a baseline at the true mean scores ≈ 0 on average, although each noisy oracle makes the raw MSE positive
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.2, 0.5, 0.9])  # success probabilities; μ = 2p − 1
    estimates = []
    for _ in range(2000):
        rewards = (torch.rand(3, 8, generator=gen) < p[:, None]).float() * 2 - 1  # [B, M]
        mean, var, count = group_moments(rewards.flatten(), torch.arange(3).repeat_interleave(8), 3)
        estimates.append(float(debiased_mse(2 * p - 1, mean, var, count)[0]))
    assert abs(sum(estimates) / len(estimates)) < 0.01


# -- the callback with a stub engine and module ----------------------------------------------------------------------
class StubEngine(RolloutEngine):
    """Prompt b = [b]; completion j of prompt b is "1" (correct) for the first round(p_b · n) draws, else "0"."""

    shares_weights = True  # a push copies nothing

    def __init__(self, p):
        self.p, self.calls = p, []

    def generate(self, prompt_token_ids, n_per_prompt, params):
        self.calls.append((list(n_per_prompt), params.seed))
        out = []
        for prompt, n in zip(prompt_token_ids, n_per_prompt):
            hits = round(self.p[prompt[0]] * n)
            out.append([Completion(torch.tensor([1 if j < hits else 0]), torch.zeros(1), "stop") for j in range(n)])
        return out


class StubTokenizer:
    pad_token_id = 9

    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(int(row[0])) for row in ids]


class StubRewards:
    stop_reason = None

    def __call__(self, prompts, texts, answers):
        return RewardBatch(torch.tensor([1.0 if t == "1" else -1.0 for t in texts]),
                           torch.zeros(len(texts), dtype=torch.bool), 0)


class StubModule:
    """What the oracle uses of a module: the rollout driver (a real one, over a stub engine), the seed key, the step
    and the rollout source's version (the weights the engine holds)."""

    def __init__(self, p, seed=0):
        self.engine = StubEngine(p)
        self.driver = RolloutDriver(self.engine, StubTokenizer(), StubRewards(), SamplingConfig(max_new_tokens=4),
                                    policy=torch.nn.Linear(1, 1))
        self.global_step, self.metrics, self.pushes, self.seed = 0, {}, [], seed
        self.counters = {"rollouts_total": 0}
        self.source = SimpleNamespace(version=0)
        push = self.driver.push

        def recorded_push(*, step, holds_mean=True):
            self.pushes.append(holds_mean)
            return push(step=step, holds_mean=holds_mean)

        self.driver.push = recorded_push

    def seed_key(self):
        return (self.seed, self.global_step)

    def log_metrics(self, metrics):
        self.metrics.update({k: float(v) for k, v in metrics.items()})


def rollouts_of(rewards_per_prompt, baseline=None, advantages=None):
    rewards = torch.tensor([r for rs in rewards_per_prompt for r in rs])
    group = torch.tensor([b for b, rs in enumerate(rewards_per_prompt) for _ in rs])
    n, b = len(rewards), len(rewards_per_prompt)
    return Rollouts(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
                    response_ids=torch.zeros(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1, dtype=torch.bool),
                    old_logp=torch.zeros(n, 1), group=group, source=torch.zeros(n, dtype=torch.long), num_groups=b,
                    prompts=[f"q{i}" for i in range(b)], answers=[0] * b, rewards=rewards, baseline=baseline,
                    advantages=advantages)


def one_step(callback, module, plan, rollouts):
    callback.on_train_batch_start(None, module, {}, 0)
    callback.on_rollout_plan(None, module, plan)
    callback.on_before_advantages(None, module, rollouts)
    callback.on_rl_step_end(None, module, rollouts)


def test_oracle_callback_group_mean_by_hand():
    # true success rates 0.25 and 0.75 → oracle means exactly −0.5 and +0.5 with M = 8 (2 and 6 hits)
    module = StubModule({0: 0.25, 1: 0.75})
    plan = RolloutPlan(["q0", "q1"], [0, 0], [[0], [1]], [4, 4])
    rollouts = rollouts_of([[1.0, 1, -1, -1], [1.0, 1, 1, 1]], advantages=torch.tensor([1.0, 1, -1, -1, 0, 0, 0, 0]))
    callback = OracleBaseline(every_n_steps=2, num_samples=8, seed=7)
    before = torch.get_rng_state()
    one_step(callback, module, plan, rollouts)
    assert torch.equal(torch.get_rng_state(), before)  # the method's random stream is untouched
    assert module.engine.calls[0][0] == [8, 8] and module.counters["rollouts_total"] == 0
    # group means 0 and 1 vs oracle −0.5, 0.5: raw = (0.25 + 0.25)/2; oracle variances (M = 8, 2 hits / 6 hits):
    # s² = 8·(1 − 0.25)·0.25·4 / 7 = 6/7 for both → noise = (6/7)/8
    assert module.metrics["repro/baseline_mse_raw"] == pytest.approx(0.25)
    assert module.metrics["repro/oracle_noise"] == pytest.approx(6 / 7 / 8)
    assert module.metrics["repro/baseline_mse"] == pytest.approx(0.25 - 6 / 56)
    assert module.metrics["repro/group_mean_mse"] == pytest.approx(module.metrics["repro/baseline_mse"])
    assert module.metrics["repro/all_zero_adv_frac"] == pytest.approx(0.5)  # prompt 1: all advantages zero
    assert module.pushes == [True]  # one weight source, the mean
    # step 1 is not sampled: the oracle's keys are NaN (Lightning would otherwise repeat step 0's values)
    module.metrics.clear()
    module.global_step = 1
    one_step(callback, module, plan, rollouts)
    assert len(module.engine.calls) == 1 and module.metrics["repro/all_zero_adv_frac"] == pytest.approx(0.5)
    assert all(math.isnan(v) for k, v in module.metrics.items() if k != "repro/all_zero_adv_frac")


def test_oracle_callback_uses_the_method_baseline_and_weight_sources():
    # a callback baseline (V0.5) is what is judged; the oracle follows the plan's weight sources (C3PO)
    module = StubModule({0: 0.5, 1: 0.5}, seed=3)
    active = []

    @contextmanager
    def weights(source):
        active.append(source)
        yield

    plan = RolloutPlan(["q0", "q1"], [0, 0], [[0], [1]], [4, 4], num_weight_sources=2, weight_context=weights)
    rollouts = rollouts_of([[1.0, 1, 1, 1], [-1.0, -1, -1, -1]], baseline=torch.tensor([0.5, 0.0]))
    callback = OracleBaseline(every_n_steps=1, num_samples=4)
    one_step(callback, module, plan, rollouts)
    assert active == [0, 1] and [c[0] for c in module.engine.calls] == [[2, 2], [2, 2]]
    assert module.engine.calls[0][1] != module.engine.calls[1][1]  # a seed per source
    assert module.pushes == [False, False]  # sampled weights: the engine no longer holds the mean
    # oracle: per source 1 hit of 2 → 2 hits of 4 per prompt, mean 0, s² = 4/3; baseline (0.5, 0)
    assert module.metrics["repro/baseline_mse_raw"] == pytest.approx(0.125)
    assert module.metrics["repro/baseline_mse"] == pytest.approx(0.125 - 1 / 3)
    assert module.metrics["repro/group_mean_mse"] == pytest.approx(1.0 - 1 / 3)  # group means ±1


def test_oracle_callback_checks_arguments():
    with pytest.raises(ValueError, match="num_samples"):
        OracleBaseline(num_samples=1)


# -- the script, tiny -------------------------------------------------------------------------------------------------
def test_reproduce_tiny(tmp_path):
    doc = tmp_path / "reproduction.md"
    cmd = [sys.executable, "scripts/reproduce.py", "--steps", "2", "--seeds", "1", "--methods", "grpo_g4,v05",
           "--batch-size", "4", "--num-test", "16", "--eval-samples", "2", "--eval-every", "1", "--oracle-every", "1",
           "--oracle-samples", "4", "--out-dir", str(tmp_path / "runs"), "--doc", str(doc)]
    env = {**os.environ, "LIT_RLVR_CACHE": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = doc.read_text()
    table = text.split("## Results (mean ± sd over seeds)", 1)[1].strip().split("\n\n", 1)[0].splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    for column in ("held-out mean@k after", "held-out pass@k after", "rollouts consumed", "tokens generated",
                   "grad-norm mean", "grad-norm sd (over steps)",
                   "entropy (last 10%)", "zero-advantage groups", "malformed", "baseline MSE vs oracle",
                   "completion length (last 10%)", "truncated (last 10%)"):
        assert column in head
    rows = [line for line in table[2:] if line.startswith("|")]
    assert [r.split("|")[1].strip() for r in rows] == ["GRPO (G = 4)", "V0.5 (k_init = 4, OSLA ≤ 16)"]
    mse = head.index("baseline MSE vs oracle")
    assert all(r.strip("|").split("|")[mse].strip() != "—" for r in rows)  # the oracle ran
    assert "python scripts/reproduce.py --steps 2" in text and "<!-- analysis:start -->" in text
    for figure in ("reproduction.png", "reproduction_heldout.png"):
        assert (tmp_path / figure).stat().st_size > 10_000
    raw = json.loads((tmp_path / "reproduction.json").read_text())
    seeds = {m: raw["methods"][m]["seeds"] for m in ("grpo_g4", "v05")}
    assert seeds["grpo_g4"][0]["rollouts"] == 2 * 4 * 4  # steps × prompts × G: oracle rollouts not counted
    assert all(s[0]["steps"] == 2 for s in seeds.values())
    # the held-out curve: before training, after step 1 (eval every step inside fit), after training
    curve = seeds["grpo_g4"][0]["curve"]
    assert [p["step"] for p in curve] == [0, 1, 2]
    assert [p["rollouts"] for p in curve] == [0, 16, 32]


def test_a_run_stopped_by_a_signal_is_not_finished(tmp_path):
    """A stopped run writes its summary too; reproduce.py must continue it, not reuse it (a study's table once
    crashed on such a run's missing accuracy)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import reproduce

    summary = tmp_path / "summary.json"
    assert not reproduce.finished(summary)
    for stopped, done in ((dict(stopped_by_sigterm=True, stopped_by_sigint=False), False),
                          (dict(stopped_by_sigterm=False, stopped_by_sigint=True), False),
                          (dict(stopped_by_sigterm=False, stopped_by_sigint=False), True)):
        summary.write_text(json.dumps({"accuracy_after": 0.5 if done else None, **stopped}))
        assert reproduce.finished(summary) is done


def test_reproduce_tasks_pin_their_settings():
    sys.path.insert(0, str(ROOT / "scripts"))
    import reproduce
    from reproduce_settings import TASKS

    args = reproduce.parse_args(["--task", "arithmetic_cot"])
    assert args.methods == TASKS["arithmetic_cot"].methods and "c3po_lora8" in args.methods
    assert Path(args.doc) == Path("runs/reproduce/arithmetic_cot/reproduction_cot.md")  # beside the runs
    run = reproduce.overrides(TASKS["arithmetic_cot"], "c3po_lora8", 2, args, Path("/tmp/x"))
    assert "data=arithmetic_cot" in run and "model.lora.rank=8" in run and "seed=2" in run
    assert f"algorithm.lr={TASKS['arithmetic_cot'].ivon_lr}" in run and "algorithm.optimizer=ivon" in run
    assert reproduce.parse_args([]).methods == ["grpo_g16", "grpo_g4", "v05", "c3po", "c3po_v05"]  # the 3-token table
    with pytest.raises(SystemExit):
        reproduce.parse_args(["--task", "arithmetic_cot", "--methods", "nope"])
    async_run = reproduce.overrides(TASKS["arithmetic_cot"], "grpo_g16_async1", 0, args, Path("/tmp/x"))
    assert "rollout.mode=async" in async_run and "rollout.max_staleness=1" in async_run
    assert not any(o.startswith(f"+{reproduce.ORACLE}") for o in async_run)  # refused with async: left out
    study = reproduce.parse_args(["--task", "arithmetic_cot", "--study", "3po"])
    assert Path(study.doc).name == "reproduction_3po.md" and {"c3po", "ivon_mean", "c3po_n8"} <= set(study.methods)
    mean_run = reproduce.overrides(TASKS["arithmetic_cot"], "ivon_mean", 0, study, Path("/tmp/x"))
    assert "algorithm.callbacks.param_noise.generate=mean" in mean_run
    assert any("DeadGroupProbe" in o for o in mean_run)  # probed
    sweep = reproduce.overrides(TASKS["arithmetic_cot"], "c3po_ess1e7", 0, study, Path("/tmp/x"))
    assert "algorithm.optimizer_options.ess=10000000.0" in sweep and not any("DeadGroupProbe" in o for o in sweep)


def test_weight_change_of_full_and_lora_runs():
    sys.path.insert(0, str(ROOT / "scripts"))
    from weight_change import weight_change

    start = {"model.layers.0.mlp.up_proj.weight": torch.ones(3, 2), "model.norm.weight": torch.ones(2)}
    full = {"state_dict": {"policy.model.layers.0.mlp.up_proj.weight": torch.full((3, 2), 1.5),
                           "policy.model.norm.weight": torch.ones(2)}, "hyper_parameters": {"lora": None}}
    change = weight_change(start, full)
    assert torch.equal(change["model.layers.0.mlp.up_proj.weight"], torch.full((3, 2), 0.5))
    assert torch.equal(change["model.norm.weight"], torch.zeros(2))
    a, b = torch.ones(1, 2), torch.arange(3.0)[:, None]  # rank 1: (α/r)·B·A
    peft = "policy.base_model.model.model.layers.0.mlp.up_proj"
    lora = {"state_dict": {f"{peft}.base_layer.weight": torch.ones(3, 2), f"{peft}.lora_A.default.weight": a,
                           f"{peft}.lora_B.default.weight": b,
                           "policy.base_model.model.model.norm.weight": torch.ones(2)},
            "hyper_parameters": {"lora": {"rank": 1, "alpha": 2.0}}}
    change = weight_change(start, lora)
    assert torch.equal(change["model.layers.0.mlp.up_proj.weight"], 2.0 * b @ a)  # the adapter, not the base
    lora["hyper_parameters"] = {"model": {"lora": {"rank": 1, "alpha": 2.0}}}  # where the settings keep it now
    assert torch.equal(weight_change(start, lora)["model.layers.0.mlp.up_proj.weight"], 2.0 * b @ a)


def test_reproduce_3po_study_tiny(tmp_path):
    """The 3PO study's rows on the 3-token task, two steps: IVON's noise and the weights' movement for both, the
    dead-group probe's arms for the probed rows, the exploration figure, the study's claims."""
    doc = tmp_path / "study.md"
    cmd = [sys.executable, "scripts/reproduce.py", "--study", "3po", "--steps", "2", "--seeds", "1", "--methods",
           "c3po,ivon_mean", "--batch-size", "2", "--num-test", "8", "--eval-samples", "2", "--eval-every", "0",
           "--oracle-every", "2", "--oracle-samples", "4", "--out-dir", str(tmp_path / "runs"), "--doc", str(doc),
           "--set", "algorithm.group_size=8"]
    env = {**os.environ, "LIT_RLVR_CACHE": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith("# 3PO tested fairly") and "### Exploration" in text
    table = text.split("### Exploration", 1)[1].split("\n\n", 2)[1].splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in table[2:]}
    for label, row in rows.items():
        for column in ("noise / weights (RMS)", "relative weight change", "dead groups (probe)"):
            assert row[head.index(column)] != "—", (label, column)
    assert "C3PO beats IVON with the mean generating" in text
    assert (tmp_path / "study_exploration.png").stat().st_size > 5_000
    raw = json.loads((tmp_path / "study.json").read_text())
    seed = raw["methods"]["c3po"]["seeds"][0]
    assert 0 < seed["noise_rel"] < 1 and 0 < seed["weight_change"] < 1 and 0 <= seed["dead_frac"] <= 1
    for method in ("c3po", "ivon_mean"):  # a rescued share exists exactly when a group was dead
        seed = raw["methods"][method]["seeds"][0]
        for arm in ("rescued_again", "rescued_weights", "rescued_hot"):
            assert (seed[arm] is None) == (seed["dead_frac"] == 0), (method, arm, seed[arm], seed["dead_frac"])


# -- the dead-group probe ---------------------------------------------------------------------------------------------
class ArmEngine(StubEngine):
    """Prompt 0 is correct only when hot (T > 1), prompt 1 only under a weight sample (the watched weight is off its
    mean 0), prompt 2 always; otherwise every completion is wrong. Records (counts, seed, temperature) per call."""

    def __init__(self, weight):
        super().__init__({})
        self.weight = weight

    def generate(self, prompt_token_ids, n_per_prompt, params):
        self.calls.append((list(n_per_prompt), params.seed, params.temperature))
        sampled = bool(self.weight.detach().abs().max() > 0)
        ok = {0: params.temperature > 1.0, 1: sampled, 2: True}
        return [[Completion(torch.tensor([1 if ok[prompt[0]] else 0]), torch.zeros(1), "stop") for _ in range(n)]
                for prompt, n in zip(prompt_token_ids, n_per_prompt)]


def test_dead_group_probe_counts_what_each_arm_rescues():
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = IVON([weight], lr=0.1, ess=1e4)
    module = StubModule({})
    module.engine = module.driver.engine = ArmEngine(weight)
    trainer = SimpleNamespace(optimizers=[optimizer], callbacks=[])
    plan = RolloutPlan(["q0", "q1", "q2"], [0] * 3, [[0], [1], [2]], [4] * 3)
    rollouts = rollouts_of([[-1.0] * 4, [-1.0] * 4, [1.0] * 4])
    probe = DeadGroupProbe(every_n_steps=2, hot_temperature=1.5, num_samples=2)
    probe.check_algorithm(SimpleNamespace(group_size=4))  # G, as the module's check hands it over
    probe.on_train_batch_start(trainer, module, {}, 0)
    probe.on_rollout_plan(trainer, module, plan)
    probe.on_before_advantages(trainer, module, rollouts)
    probe.on_rl_step_end(trainer, module, rollouts)
    m = module.metrics
    assert m["dead/frac"] == pytest.approx(2 / 3)  # prompts 0 and 1 have no correct completion at the mean
    assert (m["dead/rescued_again"], m["dead/rescued_weights"], m["dead/rescued_hot"]) == (0.0, 0.5, 0.5)
    assert m["dead/malformed_mean"] == 0.0 and m["dead/probe_s"] >= 0
    counts = [c[0] for c in module.engine.calls]
    assert counts == [[4, 4, 4], [4, 4, 4], [2, 2, 2], [2, 2, 2], [4, 4, 4]]  # mean, again, 2 samples, hot
    assert [c[2] for c in module.engine.calls] == [1.0, 1.0, 1.0, 1.0, 1.5]
    assert len({c[1] for c in module.engine.calls}) == 5  # every draw its own seed
    assert module.driver.sampling.temperature == 1.0 and torch.equal(weight.detach(), torch.zeros(3))
    assert module.counters["rollouts_total"] == 0  # not the method's rollouts
    module.metrics.clear()
    module.global_step = 1  # not probed: every key NaN, nothing drawn
    probe.on_train_batch_start(trainer, module, {}, 1)
    probe.on_rollout_plan(trainer, module, plan)
    probe.on_before_advantages(trainer, module, rollouts)
    probe.on_rl_step_end(trainer, module, rollouts)
    assert len(module.engine.calls) == 5 and all(math.isnan(v) for v in module.metrics.values())


def test_dead_group_probe_without_ivon_and_its_counting():
    assert any_correct(torch.tensor([False, True, False]), torch.tensor([0, 0, 1]), 3).tolist() == [True, False, False]
    assert math.isnan(rescued_share(torch.tensor([False]), torch.tensor([True])))
    module = StubModule({0: 0.0})
    trainer = SimpleNamespace(optimizers=[torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)], callbacks=[])
    probe = DeadGroupProbe(every_n_steps=1)
    probe.check_algorithm(SimpleNamespace(group_size=2))
    probe.on_train_batch_start(trainer, module, {}, 0)
    probe.on_rollout_plan(trainer, module, RolloutPlan(["q0"], [0], [[0]], [2]))
    probe.on_before_advantages(trainer, module, rollouts_of([[-1.0, -1.0]]))
    probe.on_rl_step_end(trainer, module, rollouts_of([[-1.0, -1.0]]))
    assert module.metrics["dead/frac"] == 1.0 and module.metrics["dead/rescued_again"] == 0.0
    assert math.isnan(module.metrics["dead/rescued_weights"])  # no posterior to sample without IVON
    for bad in (dict(every_n_steps=0), dict(hot_temperature=0.0), dict(hot_temperature=float("nan")),
                dict(num_samples=0)):
        with pytest.raises(ValueError, match="DeadGroupProbe"):
            DeadGroupProbe(**bad)


def test_dead_groups_script_counts_and_intervals(tiny_path, tmp_path):
    """scripts/dead_groups.py on the default warm-up, tiny: every arm counted against the same dead prompts, the
    Wilson interval around each share, nothing drawn twice with one seed."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import dead_groups

    low, high = dead_groups.wilson(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    assert all(math.isnan(v) for v in dead_groups.wilson(0, 0))  # no dead prompt, no share
    out = tmp_path / "dead.json"
    dead_groups.main(["--model-dir", tiny_path, "--prompts", "12", "--group-size", "2", "--num-samples", "2",
                      "--hot", "1.3", "--ess", "1e6", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["arm"] for r in rows] == ["mean (defines dead)", "again", "T = 1.3", "λ = 1e+06"]
    dead = rows[0]["n_dead"]
    assert all(r["n_dead"] == dead and 0 <= r["rescued_count"] <= dead for r in rows[1:])
    assert all(0 <= r["malformed"] <= 1 for r in rows)
