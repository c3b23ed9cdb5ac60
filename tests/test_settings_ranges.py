"""The settings classes at their range boundaries: each value just inside a bound is accepted and the one just outside
is refused with an error naming the key; the classes are frozen; the defaults a run starts from; what a resume may
change; LoRA's options and learning rate; the algorithm's views."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lit_rlvr.config.settings import (
    AlgorithmConfig,
    EngineConfig,
    EnvConfig,
    FilterGroups,
    LoraOptions,
    LossConfig,
    ModelConfig,
    OptimConfig,
    PerfConfig,
    RewardConfig,
    RolloutConfig,
    SamplingOptions,
    UpdateConfig,
    field_problems,
    resume_mutable,
    rows,
)

# (key, accepted values, refused values): the values on either side of each bound
ALGORITHM = [
    ("optimizer", ["adamw", "ivon"], ["sgd"]),
    ("lr", [1e-9], [0.0, -1e-9, None]),
    ("betas", [(0.0, 0.999), (0.9, 0.0)], [(1.0, 0.9), (0.9, 1.0), (-0.1, 0.9), (0.9,), (0.9, 0.99, 0.9), (True, 0.9)]),
    ("weight_decay", [0.0], [-1e-9]),
    ("warmup_steps", [0], [-1]),
    ("grad_clip", [None, 0.0], [-0.1]),
    ("eps_low", [0.0, 0.999], [1.0, -0.01]),
    ("eps_high", [0.0], [-0.01]),
    ("dual_clip", [None, 1.01], [1.0]),
    ("seq_mask_tau", [None, 1.01], [1.0]),
    ("loss_aggregation", ["token-mean"], ["mean"]),
    ("policy_loss", ["ppo_clip"], ["ppo"]),
    ("advantages", ["grpo"], ["gae"]),
    ("kl_coef", [0.0], [-1e-3]),
    ("kl_estimator", ["k1"], ["k4"]),
    ("kl_k3_cap", [None, 0.1], [0.0]),
    ("overlong_cache_len", [0], [-1]),
    ("overlong_penalty_factor", [0.0], [-0.1]),
    ("ppo_epochs", [1], [0]),
    ("mini_batches", [1], [0]),
    ("micro_batch_size", [1], [0]),
    ("micro_batch_tokens", [None, 1], [0]),
    ("max_bad_steps", [1], [0]),
    ("temperature", [0.01], [0.0]),
    ("top_p", [1.0, 0.01], [0.0, 1.01]),
    ("top_k", [0], [-1]),
    ("max_new_tokens", [1], [0]),
    ("eval_temperature", [0.0], [-0.1]),
    ("eval_samples", [1], [0]),
    ("group_size", [1], [0]),
]
ROLLOUT = [
    ("max_staleness", [0, 64], [-1, 65, True, 1.5]),
    ("mode", ["async"], ["asynch"]),
    ("stale_strategy", ["drop"], ["evict"]),
    ("partial_rollout", [True], ["true", 1]),
    ("kv_at_swap", ["recompute"], ["drop"]),
]
ENV = [
    ("max_turns", [None, 1], [0, 1.0, True]),
    ("max_tokens", [None, 1], [0, 2.0]),
    ("timeout_s", [None, 0.5], [0.0, -1.0, math.inf, True]),
    ("stop", [[], ["x"], ("a", "b")], [[""], "abc", [1]]),
    ("options", [{}, {"a": 1}], [[], "x"]),
]
PERF = [("peak_flops", [None, 1.0], [0.0, -1.0, True]), ("peak_bandwidth", [None, 1.0], [0.0, True])]
MODEL = [("name_or_path", ["tiny", "x/y"], ["", 5]), ("compile", [True], ["yes", 1])]
ENGINE = [("name", ["hf", "sglang", "vllm"], ["trt"])]
CASES = ([(AlgorithmConfig, "algorithm", *c) for c in ALGORITHM] + [(RolloutConfig, "rollout", *c) for c in ROLLOUT]
         + [(EnvConfig, "env", *c) for c in ENV] + [(PerfConfig, "perf", *c) for c in PERF]
         + [(ModelConfig, "model", *c) for c in MODEL] + [(EngineConfig, "engine", *c) for c in ENGINE])


@pytest.mark.parametrize("cls, section, name, accepted, refused", CASES, ids=[f"{c[1]}.{c[2]}" for c in CASES])
def test_values_either_side_of_each_bound(cls, section, name, accepted, refused):
    for value in accepted:
        cls(**{name: value})
    for value in refused:
        with pytest.raises(ValueError, match=rf"{section}\.{name}") as raised:
            cls(**{name: value})
        assert "\n" not in str(raised.value).strip(), str(raised.value)  # one line


@pytest.mark.parametrize("name", ["lr", "eps_high", "kl_coef", "entropy_coef", "temperature"])
def test_non_finite_numbers_are_refused(name):
    with pytest.raises(ValueError, match=rf"algorithm\.{name}"):
        AlgorithmConfig(**{name: math.nan})


def test_a_field_with_only_a_type_rule_takes_any_finite_value_of_it():
    assert AlgorithmConfig(entropy_coef=-5.0).entropy_coef == -5.0
    assert field_problems({"entropy_coef": -5.0, "lr": 0.1, "nonsense": -1}, AlgorithmConfig, "algorithm") == []
    (line,) = field_problems({"entropy_coef": "x"}, AlgorithmConfig, "algorithm")  # every scalar is typed
    assert line == "algorithm.entropy_coef='x' is not valid: expected a number"
    (line,) = field_problems({"lr": "x"}, AlgorithmConfig, "algorithm")  # a TypeError in the rule: refused
    assert "algorithm.lr" in line


@pytest.mark.parametrize("options, ok", [({"max_num_gen_batches": 0}, True), ({"max_num_gen_batches": 3}, True),
                                         ({"max_num_gen_batches": -1}, False), ({"max_num_gen_batches": 1.5}, False),
                                         ({"max_num_gen_batches": True}, False), ({"enable": True}, True),
                                         ({"enable": "yes"}, False), ({"metric": "score"}, True),
                                         ({"metric": "reward"}, False), ({"bogus": 1}, False)])
def test_filter_groups_options(options, ok):
    if ok:
        built = AlgorithmConfig(filter_groups=options).filter_groups
        assert isinstance(built, FilterGroups) and dataclasses.asdict(built) == {**dataclasses.asdict(FilterGroups()),
                                                                                 **options}
    else:
        with pytest.raises(ValueError, match=r"algorithm\.filter_groups\." + next(iter(options))):
            AlgorithmConfig(filter_groups=options)
    assert FilterGroups.from_options(None) == FilterGroups()
    given = FilterGroups(enable=True)
    assert FilterGroups.from_options(given) is given


FROZEN = [AlgorithmConfig(), OptimConfig(), LossConfig(), UpdateConfig(), SamplingOptions(), FilterGroups(),
          LoraOptions(), ModelConfig(), RewardConfig(), EngineConfig(), RolloutConfig(), EnvConfig(), PerfConfig()]


@pytest.mark.parametrize("settings", FROZEN, ids=[type(s).__name__ for s in FROZEN])
def test_settings_are_frozen(settings):
    name = dataclasses.fields(settings)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(settings, name, getattr(settings, name))


def test_the_defaults_a_run_starts_from():
    """The values a run without overrides uses (the algorithm's are verl's and the papers' usual ones; lr and
    max_new_tokens the tiny CPU default's: docs/results/tiny_presets.md)."""
    algorithm = dataclasses.asdict(AlgorithmConfig())
    assert {k: v for k, v in algorithm.items() if k not in ("filter_groups", "rollout_correction")} == {
        "optimizer": "adamw", "lr": 3e-4, "betas": (0.9, 0.999), "weight_decay": 0.0, "warmup_steps": 0,
        "warmup_from_zero": False, "grad_clip": 1.0, "optimizer_options": {},
        "policy_loss": "ppo_clip", "advantages": "grpo", "eps_low": 0.2, "eps_high": 0.2, "dual_clip": None,
        "seq_mask_tau": None, "loss_aggregation": "seq-mean-token-mean", "scale_adv_by_std": True, "kl_coef": 0.0,
        "kl_estimator": "k3", "kl_k3_cap": None, "entropy_coef": 0.0, "overlong_cache_len": 0,
        "overlong_penalty_factor": 1.0,
        "ppo_epochs": 1, "mini_batches": 1, "micro_batch_size": 64, "micro_batch_tokens": None, "max_bad_steps": 5,
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8, "ignore_eos": False,
        "eval_temperature": 1.0, "eval_samples": 4, "group_size": 8,
        "dbb_discount": 0.9, "dbb_prior_alpha": 1.0, "dbb_prior_beta": 1.0, "boundary_gating": False}
    assert algorithm["filter_groups"] == {"enable": False, "metric": "acc", "max_num_gen_batches": 0}
    assert dataclasses.asdict(RolloutConfig()) == {"mode": "sync", "max_staleness": 1, "stale_strategy": "wait",
                                                   "partial_rollout": False, "kv_at_swap": "keep"}
    assert dataclasses.asdict(EnvConfig()) == {"name": "none", "max_turns": None, "max_tokens": None,
                                               "timeout_s": None, "stop": [], "options": {}}
    assert LoraOptions().as_dict() == {"rank": None, "alpha": 32.0, "target_modules": "all-linear", "dropout": 0.0,
                                       "lr_scale": 10.0}
    model = ModelConfig()
    assert (model.name_or_path, model.dtype, model.chat_template, model.compile, model.options) == (
        "tiny", "float32", False, False, {})
    assert (EngineConfig().name, RewardConfig().name) == ("hf", "arithmetic")
    assert dataclasses.asdict(PerfConfig()) == {"peak_flops": None, "cache_dir": None, "peak_bandwidth": None}


def test_what_a_resume_may_change():
    assert set(resume_mutable(AlgorithmConfig, "algorithm")) == {
        "algorithm.micro_batch_size", "algorithm.max_bad_steps", "algorithm.eval_temperature",
        "algorithm.eval_samples", "algorithm.filter_groups.max_num_gen_batches"}
    assert set(resume_mutable(ModelConfig, "model")) == {"model.compile"}
    assert set(resume_mutable(EnvConfig, "env")) == {"env.timeout_s"}
    assert set(resume_mutable(RolloutConfig, "rollout")) == set()


def test_range_rows_include_the_nested_settings():
    keys = dict(rows(AlgorithmConfig, "algorithm"))
    assert {"algorithm.lr", "algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.metric"} <= set(
        keys)
    assert keys["algorithm.entropy_coef"][1] == "a number" and "algorithm.filter_groups" not in keys
    check, expected = keys["algorithm.micro_batch_size"]
    assert check(1) and not check(0) and expected == "an integer >= 1"


def test_the_algorithms_views_carry_its_values():
    algorithm = AlgorithmConfig(lr=0.5, eps_high=0.3, mini_batches=3, temperature=0.7, betas=[0.8, 0.9])
    assert algorithm.betas == (0.8, 0.9)  # a list from a config becomes a tuple
    assert algorithm.optim == OptimConfig(lr=0.5, betas=(0.8, 0.9))
    assert algorithm.loss == LossConfig(eps_high=0.3)
    assert algorithm.update == UpdateConfig(mini_batches=3)
    assert algorithm.sampling == SamplingOptions(temperature=0.7)


def test_rollout_lead():
    assert RolloutConfig(max_staleness=3).lead == 0  # sync: nothing ahead
    assert RolloutConfig(mode="async", max_staleness=3).lead == 3
    assert RolloutConfig(mode="async", max_staleness=3, stale_strategy="drop").lead == 4
    assert RolloutConfig(mode="async", max_staleness=1, stale_strategy="drop").lead == 2
    assert RolloutConfig(mode="async", max_staleness=0).lead == 0  # drop at S = 0 is refused (test_settings_refusals)


@pytest.mark.parametrize("options, message", [
    ({"rank": 0}, "model.lora.rank"), ({"rank": -1}, "model.lora.rank"), ({"rank": "x"}, "model.lora.rank"),
    ({"alpha": 0.0}, "model.lora.alpha"), ({"alpha": -1.0}, "model.lora.alpha"),
    ({"dropout": 1.0}, "model.lora.dropout"), ({"dropout": -0.1}, "model.lora.dropout"),
    ({"lr_scale": 0.0}, "model.lora.lr_scale"), ({"target_modules": "q_proj"}, "model.lora.target_modules"),
    ({"target_modules": []}, "model.lora.target_modules"), ({"alpha": math.inf}, "model.lora.alpha")])
def test_lora_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        LoraOptions(**options)


def test_lora_options_accepted_and_the_learning_rate():
    lora = LoraOptions(rank="8", alpha="0.5", dropout=0.99, lr_scale=2, target_modules=["q_proj", "v_proj"])
    assert (lora.rank, lora.alpha, lora.dropout, lora.lr_scale) == (8, 0.5, 0.99, 2.0)
    assert lora.target_modules == ("q_proj", "v_proj") and lora.as_dict()["target_modules"] == ["q_proj", "v_proj"]
    assert lora.enabled and lora.learning_rate(0.1) == pytest.approx(0.2)
    assert LoraOptions(rank=1, dropout=0.0).enabled
    off = LoraOptions()
    assert not off.enabled and off.learning_rate(0.1) == 0.1
    assert LoraOptions.from_any(None) == off and LoraOptions.from_any({"rank": 4}) == LoraOptions(rank=4)
    assert LoraOptions.from_any(lora) is lora
    with pytest.raises(ValueError, match="model.lora"):
        LoraOptions.from_any({"ranks": 4})
    assert ModelConfig(lora={"rank": 2}).lora == LoraOptions(rank=2)


def test_a_lora_rate_scale_below_one_is_allowed():
    assert LoraOptions(rank=2, lr_scale=0.5).learning_rate(1.0) == 0.5
