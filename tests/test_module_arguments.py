"""`GRPOModule`'s arguments: typed settings per config group, given as objects, mappings or shorthands, or as a
notebook's flat keywords (the constructor's arguments before the settings were typed, which old checkpoints hold)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lit_rlvr.config.arguments import module_settings
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.settings import AlgorithmConfig, EngineConfig, EnvConfig, ModelConfig, RewardConfig
from lit_rlvr.models.tiny import build_tiny

# the flat hyperparameters a checkpoint written before the settings were typed holds (GRPOModule's old arguments)
OLD_HPARAMS = {"model": "tiny", "model_options": {"target": 0.3}, "dtype": "float32", "lora": None,
               "reward": "arithmetic", "reward_options": None, "engine": "hf", "engine_options": {"max_batch": 64},
               "group_size": 4, "lr": 1e-4, "betas": (0.9, 0.99), "optimizer_options": None, "filter_groups": None,
               "rollout_correction": None, "micro_batch_tokens": None, "max_new_tokens": 8, "seed": 3,
               "perf_options": {"peak_flops": 1e12, "cache_dir": None}, "compile_update": False, "env": None,
               "env_options": None, "chat_template": False}


def _settings(model="tiny", algorithm=None, reward="arithmetic", engine="hf", env=None, perf=None, seed=0,
              **shortcuts):
    return module_settings(model, algorithm, reward, engine, env, perf, seed, shortcuts)


def test_every_way_of_giving_a_setting_builds_the_same_settings():
    typed = _settings(ModelConfig(options={"target": 0.3}), AlgorithmConfig(group_size=4, lr=1e-4),
                      RewardConfig("arithmetic"), EngineConfig("hf", options={"max_batch": 64}), EnvConfig(), seed=3)
    mappings = _settings({"options": {"target": 0.3}}, {"group_size": 4, "lr": 1e-4}, {"name": "arithmetic"},
                         {"options": {"max_batch": 64}}, {"name": "none"}, seed=3)
    flat = _settings(model_options={"target": 0.3}, group_size=4, lr=1e-4, engine_options={"max_batch": 64}, seed=3)
    assert typed == mappings == flat
    assert module_settings(**{**typed.as_dict(), "shortcuts": {}}) == typed  # the saved hyperparameters read back


def test_a_checkpoint_written_before_the_settings_were_typed_builds_its_settings():
    named = ("model", "reward", "engine", "env", "seed")  # still GRPOModule's parameters, now with shorthands
    settings = module_settings(algorithm=None, perf=None, **{k: OLD_HPARAMS[k] for k in named},
                               shortcuts={k: v for k, v in OLD_HPARAMS.items() if k not in named})
    assert settings.algorithm.group_size == 4 and settings.algorithm.lr == 1e-4
    assert settings.algorithm.betas == (0.9, 0.99) and settings.model.options == {"target": 0.3}
    assert settings.engine.options == {"max_batch": 64} and settings.perf.peak_flops == 1e12
    assert settings.env.name == "none" and settings.seed == 3


@pytest.mark.parametrize("kwargs, line", [
    ({"lrr": 1e-4}, "lrr is not an option (did you mean lr?)"),
    ({"algorithm": {"eps_lo": 0.1}}, "algorithm.eps_lo is not an option (did you mean algorithm.eps_low?)"),
    ({"algorithm": {"filter_groups": {"enabled": True}}},
     "algorithm.filter_groups.enabled is not an option (did you mean algorithm.filter_groups.enable?)"),
    ({"model": {"lora_rank": 8}}, "model.lora_rank is not an option"),
    ({"algorithm": 3}, "algorithm=3 is not valid: expected a mapping of {"),
])
def test_an_unknown_key_is_one_line_naming_a_close_match(kwargs, line):
    with pytest.raises(ConfigError) as caught:
        _settings(**kwargs)
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(line), caught.value.problems


def test_python_defaults_are_train_pys():
    """The settings a notebook gets without arguments are the embedded default's (lr, budget, evaluation): they
    once disagreed (lr 1e-5 vs 3e-4, max_new_tokens 24 vs 8, eval_temperature 0 vs 1)."""
    algorithm = _settings().algorithm
    assert (algorithm.lr, algorithm.max_new_tokens, algorithm.eval_temperature, algorithm.eval_samples) == (
        3e-4, 8, 1.0, 4)


def test_a_model_object_with_its_tokenizer_trains_as_the_policy():
    from lit_rlvr.module import GRPOModule

    policy, tokenizer = build_tiny()
    module = GRPOModule(model=policy, tokenizer=tokenizer, group_size=2)
    assert module.policy is policy and module.tokenizer is tokenizer and module.model_path is None
    assert module.settings.model.name_or_path == type(policy).__name__
    with pytest.raises(ConfigError, match="needs its tokenizer"):
        GRPOModule(model=policy)


@pytest.mark.parametrize("build, line", [
    (lambda: AlgorithmConfig(lr="abc"), "algorithm.lr='abc' is not valid: expected a number > 0"),
    (lambda: replace(AlgorithmConfig(), lr=math.inf), "algorithm.lr=inf is not valid: expected a finite number"),
    (lambda: AlgorithmConfig(betas=(0.9,)), "algorithm.betas=(0.9,) is not valid: expected two numbers in [0, 1)"),
    (lambda: AlgorithmConfig(betas=(1.5, 0.9)), "algorithm.betas=(1.5, 0.9) is not valid"),
    (lambda: ModelConfig(compile="maybe"), "model.compile='maybe' is not valid: expected true or false"),
    (lambda: EngineConfig("vlm"), "engine.name='vlm' is not valid: expected one of hf, sglang, vllm"),
    (lambda: EnvConfig(max_turns=0), "env.max_turns=0 is not valid"),
    (lambda: _settings(model=5), "model=5 is not valid"),
    (lambda: _settings(seed="abc"), "seed='abc' is not valid: expected an integer"),
    (lambda: _settings(algorithm=AlgorithmConfig(lr=1e-4), lr=1e-3), "lr and algorithm= both set algorithm settings"),
    (lambda: _settings(model={"options": {"lr": 5e-4}}, model_options={"target": 0.2}),
     "model_options and model= both set model settings"),
])
def test_a_settings_object_refuses_what_train_py_refuses_wherever_it_is_built(build, line):
    """Built in Python, by `replace` or by the constructor's arguments: the same one line as train.py's check."""
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.problems[0].startswith(line), caught.value.problems
