"""DAPO, Dr. GRPO and GSPO as config values of GRPOModule: hand-worked loss numbers, DAPO's dynamic sampling
(`filter_groups`), and the shipped configs."""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.algorithms import GenerationBudgetError
from lit_rlvr.run.one_line import one_line
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.module import GRPOModule
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.rewards.base import RewardResult, RewardRunner
from lit_rlvr.rollout.batch import Rollouts
from tiny_options import TINY as TINY_OPTIONS

CACHE = os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr")
TINY = {"cache_dir": CACHE, **TINY_OPTIONS}  # = conf/model/tiny.yaml


# the options conf/algorithm/{dapo,dr_grpo,gspo}.yaml set over grpo.yaml (test_algorithm_configs_instantiate)
DAPO = {"eps_low": 0.2, "eps_high": 0.28, "loss_aggregation": "token-mean", "overlong_cache_len": 3,
        "overlong_penalty_factor": 1.0, "filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 4}}
DR_GRPO = {"advantages": "dr_grpo", "scale_adv_by_std": False, "loss_aggregation": "seq-mean-token-sum-norm"}
GSPO = {"policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "mini_batches": 2,
        "loss_aggregation": "seq-mean-token-mean"}


def tiny(options=None, **kwargs):
    return GRPOModule(model="tiny", model_options=dict(TINY),
                      **{"group_size": 4, "max_new_tokens": 8, **(options or {}), **kwargs})


def batch_of(rewards: list[list[float]], lengths: list[int], width: int = 8) -> Rollouts:
    """A Rollouts with the given per-group rewards and response lengths (token ids are irrelevant here)."""
    flat = [r for group in rewards for r in group]
    n = len(flat)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # [N, T]
    return Rollouts(
        prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
        response_ids=torch.zeros(n, width, dtype=torch.long), response_mask=mask, old_logp=torch.zeros(n, width),
        group=torch.tensor([g for g, group in enumerate(rewards) for _ in group]),
        source=torch.zeros(n, dtype=torch.long),
        num_groups=len(rewards), prompts=[f"p{g}" for g in range(len(rewards))], answers=[0] * len(rewards),
        rewards=torch.tensor(flat), malformed=torch.zeros(n, dtype=torch.bool))


# -- DAPO: clip-higher + token-mean ------------------------------------------------------------------------------
# seq 0: A = +1, ratios (1.5, 0.5, pad); seq 1: A = −1, ratios (1.25, 0.7, 1.0).
RATIOS = torch.tensor([[1.5, 0.5, 9.0], [1.25, 0.7, 1.0]])
MASK = torch.tensor([[True, True, False], [True, True, True]])
ADV = torch.tensor([1.0, -1.0])


def test_dapo_loss_token_mean_with_clip_higher():
    module = tiny(DAPO)
    assert (module.algorithm.eps_low, module.algorithm.eps_high, module.algorithm.loss_aggregation) == (
        0.2, 0.28, "token-mean")
    logp = torch.log(RATIOS)
    loss, metrics = module.policy_loss(logp, torch.zeros_like(logp), ADV, MASK, None)
    # surrogates min(rA, clip(r, 0.8, 1.28)A): 1.28, 0.5 | −1.25, −0.8, −1.0; token mean over 5 tokens
    assert loss.item() == pytest.approx(-(1.28 + 0.5 - 1.25 - 0.8 - 1.0) / 5)  # 0.254
    assert metrics["loss/pg_clipfrac"].item() == pytest.approx(2 / 5)  # (seq 0, tok 0) and (seq 1, tok 1)
    # the symmetric clip (1.2) and the per-sequence mean give other numbers: the test can tell them apart
    sym, _ = F.ppo_clip_loss(logp, torch.zeros_like(logp), ADV, MASK, eps_low=0.2, eps_high=0.2,
                             aggregation="token-mean")
    assert sym.item() == pytest.approx(-(1.2 + 0.5 - 1.25 - 0.8 - 1.0) / 5)  # 0.27
    seq, _ = F.ppo_clip_loss(logp, torch.zeros_like(logp), ADV, MASK, eps_low=0.2, eps_high=0.28,
                             aggregation="seq-mean-token-mean")
    assert seq.item() == pytest.approx(-((1.28 + 0.5) / 2 + (-1.25 - 0.8 - 1.0) / 3) / 2)


def test_overlong_penalty_eq13():
    penalty, metrics = F.overlong_penalty(torch.tensor([3, 5, 6, 7, 8, 9]), max_len=8, cache_len=3)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -1 / 3, -2 / 3, -1.0, -1.0])
    assert metrics["reward/overlong_frac"].item() == pytest.approx(4 / 6)
    assert F.overlong_penalty(torch.tensor([8]), max_len=8, cache_len=0)[0].tolist() == [0.0]
    with pytest.raises(ValueError, match="cache_len"):
        F.overlong_penalty(torch.tensor([1]), max_len=8, cache_len=9)


def test_dapo_advantages_add_overlong_penalty():
    module = tiny(DAPO, overlong_cache_len=3)
    # one group, rewards (1, 1, −1, −1), lengths (2, 7, 2, 8): shaped (1, 1/3, −1, −2), mean −0.4167
    rollouts = batch_of([[1.0, 1.0, -1.0, -1.0]], [2, 7, 2, 8])
    adv, metrics = module.compute_advantages(rollouts)
    shaped = torch.tensor([1.0, 1 / 3, -1.0, -2.0])
    expected = (shaped - shaped.mean()) / (shaped.std() + 1e-6)
    assert adv.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert rollouts.rewards.tolist() == [1.0, 1.0, -1.0, -1.0]  # the task reward is left as it is
    assert metrics["reward/overlong_frac"].item() == pytest.approx(0.5)


def test_constant_groups():
    rewards = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 0.5])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 4])
    assert F.constant_groups(rewards, group, 5).tolist() == [True, False, True, False, True]
    # group 3 has no completions: it is not "constant"


# -- Dr. GRPO ------------------------------------------------------------------------------------------------------
def test_dr_grpo_advantages_and_sum_norm():
    module = tiny(DR_GRPO)
    rollouts = batch_of([[1.0, -1.0, -1.0], [1.0, 1.0]], [2, 3, 1, 4, 4])
    adv, metrics = module.compute_advantages(rollouts)
    # group 0 mean −1/3 → (4/3, −2/3, −2/3), no division by the std (≈ 1.155); group 1 constant → 0
    assert adv.tolist() == pytest.approx([4 / 3, -2 / 3, -2 / 3, 0.0, 0.0])
    assert metrics["groups/zero_adv_frac"].item() == pytest.approx(0.5)
    # ratio 1: per-token surrogate = A; seq sums 8/3 (2 tok), −2 (3 tok), divided by max_new_tokens = 8
    logp = torch.zeros(2, 8)
    mask = torch.arange(8)[None, :] < torch.tensor([[2], [3]])
    loss, _ = module.policy_loss(logp, logp, torch.tensor([4 / 3, -2 / 3]), mask, None)
    assert loss.item() == pytest.approx(-((8 / 3) / 8 + (-2) / 8) / 2)  # −1/24
    grpo_like, _ = F.ppo_clip_loss(logp, logp, torch.tensor([4 / 3, -2 / 3]), mask, aggregation="seq-mean-token-mean")
    assert grpo_like.item() == pytest.approx(-(4 / 3 - 2 / 3) / 2)  # 1/|o_i| instead: a different number


def test_contradicting_options_are_refused():
    with pytest.raises(ValueError, match="algorithm.scale_adv_by_std"):
        tiny(DR_GRPO, scale_adv_by_std=True)
    with pytest.raises(ValueError, match="algorithm.dual_clip"):  # a sequence-level clip: no per-token floor
        tiny(GSPO, dual_clip=3.0)


@pytest.mark.parametrize("key, valid", [("policy_loss", "ppo_clip, gspo"), ("advantages", "grpo, dr_grpo, dbb")])
def test_unknown_loss_or_advantage_name_lists_the_valid_ones(key, valid):
    with pytest.raises(ConfigError) as err:
        tiny(**{key: "nope"})
    assert err.value.problems == [f"algorithm.{key}='nope' is not valid: expected one of {valid}"]


def test_filter_groups_options_are_checked():
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups\.max_num_gen_batche\b"):
        tiny(filter_groups={"enable": True, "max_num_gen_batche": 3})
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups\.metric='seq_reward' is not valid: expected "
                                          r"one of acc, score"):
        tiny(filter_groups={"enable": True, "metric": "seq_reward"})
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups=True is not valid: expected a mapping"):
        tiny(filter_groups=True)


def test_dr_grpo_passes_dual_clip_to_its_loss():
    module = tiny(DR_GRPO, dual_clip=3.0)
    logp, mask = torch.tensor([[1.5, 0.5]]), torch.ones(1, 2, dtype=torch.bool)  # ratios e^1.5 > 3, e^0.5
    loss, metrics = module.policy_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), mask, None)
    assert metrics["loss/pg_clipfrac_lower"].item() == pytest.approx(0.5)


# -- GSPO ----------------------------------------------------------------------------------------------------------
def test_gspo_sequence_ratio_and_clip():
    module = tiny(GSPO)
    assert (module.algorithm.eps_low, module.algorithm.eps_high) == (3e-4, 4e-4)
    # log ratios; seq 0 (A=+1): mean(0.1, −0.3) = −0.1 → s = 0.904837 (below 1 − ε: unclipped term is smaller)
    # seq 1 (A=+1): mean(0.2, 0, 0.1) = 0.1 → s = 1.105171, clipped to 1.0004
    # seq 2 (A=−1): mean(0.3, 0.3) = 0.3 → s = 1.349859, min(−1.349859, −1.0004) = −1.349859 (unclipped)
    log_ratio = torch.tensor([[0.1, -0.3, 5.0], [0.2, 0.0, 0.1], [0.3, 0.3, -7.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, False]])
    logp = log_ratio.clone().requires_grad_(True)
    loss, metrics = module.policy_loss(logp, torch.zeros(3, 3), torch.tensor([1.0, 1.0, -1.0]), mask, None)
    s0, s2 = math.exp(-0.1), math.exp(0.3)
    assert loss.item() == pytest.approx(-(s0 + 1.0004 - s2) / 3, rel=1e-6)
    assert metrics["loss/pg_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d(−s_i A_i / 3)/d logp_t = −A_i s_i / (3 |o_i|) on counted tokens; 0 for the clipped sequence and padding
    assert logp.grad[0].tolist() == pytest.approx([-s0 / 6, -s0 / 6, 0.0], rel=1e-5)
    assert logp.grad[1].tolist() == [0.0, 0.0, 0.0]
    assert logp.grad[2].tolist() == pytest.approx([s2 / 6, s2 / 6, 0.0], rel=1e-5)


def test_gspo_token_weights_weight_each_tokens_term_of_the_token_level_form():
    """Eq. 10's token-level form, as verl: w_t scales token t's term (and only its gradient); the sequence's value is
    its clipped term times its tokens' mean weight. With w = 1 it is the sequence-level loss (value and gradient)."""
    log_ratio = torch.tensor([[0.1, -0.3, 5.0], [0.2, 0.0, 0.1], [0.3, 0.3, -7.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    s0, s2 = math.exp(-0.1), math.exp(0.3)

    def loss_and_grad(weights, aggregation="seq-mean-token-mean"):
        logp = log_ratio.clone().requires_grad_(True)
        loss, _ = F.gspo_loss(logp, torch.zeros(3, 3), adv, mask, token_weights=weights, aggregation=aggregation)
        loss.backward()
        return loss.item(), logp.grad

    plain, plain_grad = loss_and_grad(None)
    ones, ones_grad = loss_and_grad(torch.ones(3, 3))
    assert ones == pytest.approx(plain, rel=1e-6) and torch.allclose(ones_grad, plain_grad, atol=1e-7)
    loss, grad = loss_and_grad(torch.tensor([[0.5, 1.5, 0.0], [2.0, 2.0, 2.0], [1.0, 0.0, 9.0]]))
    assert loss == pytest.approx(-(s0 * 1.0 + 1.0004 * 2.0 - s2 * 0.5) / 3, rel=1e-6)
    assert grad[0].tolist() == pytest.approx([-0.5 * s0 / 6, -1.5 * s0 / 6, 0.0], rel=1e-5)
    assert grad[1].tolist() == [0.0, 0.0, 0.0]  # clipped: no gradient whatever its weights
    assert grad[2].tolist() == pytest.approx([s2 / 6, 0.0, 0.0], rel=1e-5)
    token_mean, _ = loss_and_grad(None, "token-mean")  # another aggregation: the token terms' mean over 7 tokens
    assert token_mean == pytest.approx(-(2 * s0 + 3 * 1.0004 - 2 * s2) / 7, rel=1e-6)


# -- DAPO dynamic sampling -----------------------------------------------------------------------------------------
def stub_reward(constant_for):
    """Rewards that depend only on the prompt: constant (−1) when `constant_for(prompt)`, else +1/−1 alternating
    within the group (so the group is non-constant)."""
    calls = {"n": 0}

    def fn(prompt, completion, answer):
        calls["n"] += 1
        return RewardResult(-1.0 if constant_for(prompt) or calls["n"] % 2 else 1.0, False)

    return fn


class Recorder(RLVRCallback):
    def __init__(self):
        self.trained, self.metrics = [], []

    def on_before_advantages(self, trainer, pl_module, rollouts):
        self.trained.append(rollouts)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in pl_module.step_metrics.items()})


def fit_dapo(constant_for, steps: int, **kwargs) -> tuple[Recorder, RLVRDataModule]:
    pl.seed_everything(0, verbose=False)
    # no overlong shaping: it depends on how long the model's completions run, which varies with where the
    # warm-up landed; these tests are about the groups that the rewards alone make constant
    module = tiny(DAPO, **{"overlong_cache_len": 0, **kwargs})
    module.reward_runner = RewardRunner(stub_reward(constant_for))
    data = RLVRDataModule(batch_size=4, seed=0)
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[recorder])
    trainer.fit(module, datamodule=data)
    return recorder, data


def is_odd(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % 2 == 1


def test_dapo_dynamic_sampling_fills_batch_from_next_prompts():
    recorder, data = fit_dapo(is_odd, steps=2, filter_groups={"enable": True, "max_num_gen_batches": 9})
    fresh = RLVRDataModule(batch_size=4, seed=0)  # the run's data order from the start (the run's own
    fresh.setup("fit")  # datamodule now holds the position it stopped at)
    batches = iter(fresh.train_dataloader())  # a step takes whole batches until it has
    expected = []  # 4 usable prompts, and discards the surplus of its last batch (as verl's DAPO recipe)
    for _step in range(2):
        usable = []
        while len(usable) < 4:
            usable += [p for p in next(batches)["prompt"] if not is_odd(p)]
        expected += usable[:4]
    trained = [p for rollouts in recorder.trained for p in rollouts.prompts]
    assert trained == expected
    for rollouts, m in zip(recorder.trained, recorder.metrics):
        assert rollouts.num_groups == 4 and rollouts.num_samples == 16
        assert not F.constant_groups(rollouts.rewards, rollouts.group, rollouts.num_groups).any()
        assert m["dapo/kept_groups"] == 4 and m["dapo/cap_hit"] == 0
        assert m["groups/zero_adv_frac"] == 0
        assert m["rollouts/per_step"] == 16 * (1 + m["dapo/refill_rounds"])  # dropped groups were generated too
    assert sum(m["dapo/refill_rounds"] for m in recorder.metrics) >= 1


def test_dapo_dynamic_sampling_stops_past_its_budget():
    """As verl: a step that spent `max_num_gen_batches` without enough varied groups stops the run, naming the key."""
    with pytest.raises(GenerationBudgetError) as err:
        fit_dapo(lambda prompt: True, steps=1, filter_groups={"enable": True, "max_num_gen_batches": 3})
    (line,) = err.value.problems
    assert line.startswith(
        "algorithm.filter_groups.max_num_gen_batches=3: 3 generation batches gave 0 of 4 groups whose acc differs; "
        "raise it (0 = no limit), or set algorithm.filter_groups.enable=false; ")
    assert line.endswith("(the cap may change on resume)") and "checkpoint" in line  # what the stopped run keeps
    assert one_line(err.value)[0] == "stopped"  # the entry points' line: a stop mid-run, not a refused setting



def test_a_step_that_keeps_refilling_says_so(caplog):
    """Without a cap a step refills until its batch is full: after 10 generation batches it says how far it got."""
    from lit_rlvr.algorithms import FilterGroups, GroupFilter

    batches = iter([{"prompt": ["p"]}] * 11)
    constant = GroupFilter(FilterGroups(enable=True, max_num_gen_batches=0), pad_token_id=0)
    with caplog.at_level("WARNING"):
        rollouts, metrics = constant.collect({"prompt": ["p"]}, lambda batch, seeds: batch_of([[1.0, 1.0]], [2, 2]),
                                             lambda: next(batches, None))
    assert metrics["dapo/refill_rounds"] == 11 and metrics["dapo/cap_hit"] == 1.0  # the data ran out
    (line,) = [r.getMessage() for r in caplog.records if "generation batches" in r.getMessage()]
    assert line.startswith("algorithm.filter_groups: 10 generation batches in this step gave 0 of 1 groups")


# -- shipped configs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, options", [("dapo", DAPO), ("dr_grpo", DR_GRPO), ("gspo", GSPO)])
def test_algorithm_configs_instantiate(name, options, tmp_path):
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.recipe import build_module

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("config", overrides=[f"algorithm={name}", f"cache_dir={CACHE}"])
    module = build_module(cfg)
    assert type(module) is GRPOModule and cfg.algorithm.name == name
    assert {k: dataclasses.asdict(module.algorithm)[k] for k in options} == options
