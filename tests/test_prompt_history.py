"""DBB's discounted Beta–Bernoulli baseline, boundary gating and the Beta-posterior / uniform allocation
(lit_rlvr/functional/prompt_history.py, lit_rlvr/algorithms/prompt_history.py): the math against hand-worked numbers,
the part on a batch, the settings' checks, and a resumed run's history equal to the uninterrupted run's."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.algorithms.prompt_history import PromptHistory, history_parts
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.settings import AlgorithmConfig, HistoryOptions
from lit_rlvr.hooks import RLVRCallback, check_rl_callbacks
from lit_rlvr.rollout.batch import Rollouts

REPO = Path(__file__).resolve().parents[1]


def test_discounted_update_by_hand():
    # prior Beta(1, 1), γ = 0.5: history (α, β) = (3, 5); this step 2 successes, 1 failure
    # α = 1 + 0.5·(3 − 1) + 2 = 4;  β = 1 + 0.5·(5 − 1) + 1 = 4
    alpha, beta = F.discounted_beta_update(torch.tensor([3.0, 1.0]), torch.tensor([5.0, 1.0]),
                                           torch.tensor([2.0, 0.0]), torch.tensor([1.0, 4.0]),
                                           discount=0.5, prior_alpha=1.0, prior_beta=1.0)
    assert alpha.tolist() == [4.0, 1.0] and beta.tolist() == [4.0, 5.0]
    # γ = 1: the plain Beta–Bernoulli posterior (counts add up)
    alpha, beta = F.discounted_beta_update(torch.tensor([3.0]), torch.tensor([5.0]), torch.tensor([2.0]),
                                           torch.tensor([1.0]), discount=1.0, prior_alpha=1.0, prior_beta=1.0)
    assert (alpha.item(), beta.item()) == (5.0, 6.0)


def test_beta_mean_std_by_hand():
    # Beta(1, 5): p̂ = 1/6; μ = −1 + 2/6 = −2/3; σ = 2·√(1/6 · 5/6) = √5/3
    mean, std = F.beta_mean_std(torch.tensor([1.0]), torch.tensor([5.0]))
    assert mean.item() == pytest.approx(-2 / 3) and std.item() == pytest.approx(math.sqrt(5) / 3)


def test_dbb_advantages_by_hand():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0])  # prompt 0: one success of 2; prompt 1: none of 2
    group = torch.tensor([0, 0, 1, 1])
    baseline = torch.tensor([0.0, -0.5])
    adv, metrics = F.dbb_advantages(rewards, group, 2, baseline=baseline)
    # σ(μ=0) = 1; σ(μ=−0.5) = √(1.5·0.5) = √0.75: an all-wrong group still gets (−1 + 0.5)/√0.75
    assert adv.tolist() == pytest.approx([1.0, -1.0, -0.5 / math.sqrt(0.75), -0.5 / math.sqrt(0.75)])
    assert metrics["groups/zero_adv_frac"].item() == 0.0
    adv, _ = F.dbb_advantages(rewards, group, 2, scale_by_std=False, baseline=baseline)
    assert adv.tolist() == pytest.approx([1.0, -1.0, -0.5, -0.5])
    with pytest.raises(ValueError, match="advantages=dbb"):
        F.dbb_advantages(rewards, group, 2)
    assert F.ADVANTAGES["dbb"] is F.dbb_advantages


def test_group_outcomes():
    wins, losses = F.group_outcomes(torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0]), torch.tensor([0, 0, 1, 1, 2]), 4)
    assert wins.tolist() == [1.0, 2.0, 0.0, 0.0] and losses.tolist() == [1.0, 0.0, 1.0, 0.0]


def _rollouts(prompts, rewards, group):
    n = len(rewards)
    return Rollouts(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
                    response_ids=torch.zeros(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1, dtype=torch.bool),
                    old_logp=torch.zeros(n, 1), group=torch.tensor(group), source=torch.zeros(n, dtype=torch.long),
                    num_groups=len(prompts), prompts=list(prompts), answers=[None] * len(prompts),
                    rewards=torch.tensor(rewards))


class _Module:
    def __init__(self):
        self.logged = {}

    def log_metrics(self, metrics):
        self.logged.update(metrics)


def _step(part, rollouts):
    module = _Module()
    part.on_train_batch_start(None, module, None, 0)
    part.on_before_advantages(None, module, rollouts)
    part.on_rl_step_end(None, module, rollouts)
    return module.logged


def test_part_sets_the_posterior_mean_and_keeps_history():
    part = PromptHistory(HistoryOptions(dbb_discount=0.5), dbb=True)
    first = _rollouts(["a", "b"], [1.0, -1.0, -1.0, -1.0], [0, 0, 1, 1])
    _step(part, first)
    # a: Beta(1 + 1, 1 + 1) → μ = 0; b: Beta(1, 1 + 2) → p̂ = 1/4, μ = −0.5
    assert first.baseline.tolist() == pytest.approx([0.0, -0.5])
    assert part.records["a"] == [2.0, 2.0, 1.0] and part.records["b"] == [1.0, 3.0, 0.0]
    second = _rollouts(["b"], [1.0, 1.0], [0, 0])
    _step(part, second)
    # b: α = 1 + 0.5·0 + 2 = 3, β = 1 + 0.5·2 + 0 = 2 → p̂ = 3/5, μ = 0.2
    assert second.baseline.tolist() == pytest.approx([0.2])
    assert part.records["b"] == [3.0, 2.0, 1.0]


def test_gate_zeroes_prompts_solved_before_only():
    part = PromptHistory(HistoryOptions(boundary_gating=True), dbb=False)
    first = _rollouts(["a", "b"], [1.0, -1.0, -1.0, -1.0], [0, 0, 1, 1])
    logged = _step(part, first)
    assert first.update_groups.tolist() == [True, True]  # a's first success teaches
    assert first.baseline is None and logged["history/gated_frac"].item() == 0.0
    second = _rollouts(["a", "b", "c"], [1.0, -1.0, 1.0, -1.0, 1.0, -1.0], [0, 0, 1, 1, 2, 2])
    logged = _step(part, second)
    assert second.update_groups.tolist() == [False, True, True]
    assert logged["history/gated_frac"].item() == pytest.approx(1 / 3)
    # the module's advantage: the gated prompt's completions give no policy gradient
    adv, _ = F.grpo_advantages(second.rewards, second.group, 3)
    gated = adv * second.update_groups[second.group].to(adv.dtype)
    assert gated[:2].tolist() == [0.0, 0.0] and gated[2:].abs().min() > 0


def test_a_step_that_fails_keeps_nothing():
    part = PromptHistory(HistoryOptions(), dbb=True)
    part.on_train_batch_start(None, _Module(), None, 0)
    part.on_before_advantages(None, _Module(), _rollouts(["a"], [1.0, 1.0], [0, 0]))
    part.on_train_batch_start(None, _Module(), None, 1)  # the step raised before its end
    part.on_rl_step_end(None, _Module(), _rollouts(["a"], [1.0, 1.0], [0, 0]))
    assert part.records == {}


def test_settings_checked_and_parts_chosen():
    for key, value in (("dbb_discount", 0.0), ("dbb_discount", 1.5), ("dbb_prior_alpha", 0.0),
                       ("dbb_prior_beta", -1.0), ("boundary_gating", "yes")):
        with pytest.raises(ConfigError, match=f"algorithm.{key}="):
            AlgorithmConfig(**{key: value})
    assert history_parts(AlgorithmConfig()) == []
    assert [p.dbb for p in history_parts(AlgorithmConfig(advantages="dbb"))] == [True]
    assert [p.dbb for p in history_parts(AlgorithmConfig(boundary_gating=True))] == [False]
    assert AlgorithmConfig().history == HistoryOptions()


def test_two_baselines_refused():
    class Other(RLVRCallback):
        sets_baseline = True

    with pytest.raises(ConfigError, match="baseline"):
        check_rl_callbacks([Other(), PromptHistory(dbb=True)], AlgorithmConfig(advantages="dbb"))
    check_rl_callbacks([Other(), PromptHistory(dbb=False)], AlgorithmConfig(boundary_gating=True))


@pytest.mark.parametrize("p_hat", [[0.5, 0.1, 0.9, 0.5], [0.01, 0.99, 0.3, 0.7]])
def test_allocations_spend_the_same_budget(p_hat):
    counts, total = [4, 4, 4, 4], 36  # mean 9 rollouts per prompt
    uniform = F.uniform_allocation(counts, total, k_max=16)
    beta = F.beta_allocation(p_hat, counts, total, k_max=16)
    assert sum(counts) + sum(uniform) == total == sum(counts) + sum(beta)
    assert uniform == [5, 5, 5, 5]
    assert all(0 <= e <= 12 for e in beta)


def test_beta_allocation_by_hand():
    # weights √(p(1−p)): 0.5 → 0.5, 0.1 → 0.3: shares of 16 samples 10 and 6, minus the 2 already drawn each
    assert F.beta_allocation([0.5, 0.1], [2, 2], 16, k_max=16) == [8, 4]
    # capped at k_max: the rest goes to the other prompt
    assert F.beta_allocation([0.5, 0.001], [2, 2], 12, k_max=8) == [6, 2]
    assert F.uniform_allocation([2, 2, 2], 10, k_max=16) == [2, 1, 1]


def test_resumed_history_equals_uninterrupted(tmp_path):
    """A 4-step DBB + gate run and a 2-step run resumed to 4 end with the same history in last.ckpt."""
    small = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
             "algorithm.group_size=4", "checkpoint_every=1", "data.num_train=8", "algorithm.advantages=dbb",
             "algorithm.boundary_gating=true"]

    def run(run_dir, steps, *extra):
        proc = subprocess.run([sys.executable, "train.py", *small, f"trainer.max_steps={steps}",
                               f"hydra.run.dir={run_dir}", *extra], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ), timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    run(tmp_path / "full", 4)
    run(tmp_path / "part", 2)
    run(tmp_path / "part", 4, f"resume={tmp_path / 'part' / 'checkpoints' / 'last.ckpt'}")

    def history(run_dir):
        ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        states = [v for k, v in ckpt["callbacks"].items() if "PromptHistory" in k]
        assert len(states) == 1
        return states[0]["records"]

    full, resumed = history(tmp_path / "full"), history(tmp_path / "part")
    assert len(full) == 8  # 4 steps of 4 prompts over 8: every prompt seen twice
    assert full.keys() == resumed.keys()
    for prompt in full:
        assert resumed[prompt] == pytest.approx(full[prompt], abs=1e-9)
    assert any(r[2] == 1.0 for r in full.values())


def test_composes_with_losses_lora_and_async(tmp_path):
    """DBB and the gate with GSPO's loss, with LoRA adapters, and with asynchronous rollouts: each a 3-step
    `python train.py` run on 4 prompts (every step sees them again) that logs the history's metrics."""
    small = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
             "algorithm.group_size=4", "trainer.max_steps=3", "data.num_train=4", "algorithm.advantages=dbb",
             "algorithm.boundary_gating=true"]
    variants = {"gspo": ["algorithm.policy_loss=gspo"], "lora": ["model.lora.rank=4"], "async": ["rollout.mode=async"]}
    procs = {name: subprocess.Popen([sys.executable, "train.py", *small, *extra, f"hydra.run.dir={tmp_path / name}"],
                                    cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=dict(os.environ))
             for name, extra in variants.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, (name, out[-3000:])
        rows = [r for r in csv.DictReader((tmp_path / name / "metrics.csv").open()) if r.get("reward/mean")]
        assert len(rows) == 3, name
        assert float(rows[0]["history/seen_frac"]) == 0.0 and float(rows[-1]["history/seen_frac"]) == 1.0, name
        assert float(rows[0]["history/gated_frac"]) == 0.0 and rows[-1]["history/dbb_mean"] != "", name
