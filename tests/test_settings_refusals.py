"""Hostile settings, fourth round (issue 61, classes 11-13): every bad value is one line naming its key, from every
entry point, before any work; nonsense that would run is refused; a default is valid with the default model."""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lit_rlvr.app.config_check import check_config
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.settings import (AlgorithmConfig, DataConfig, EngineConfig, EnvConfig, LoraOptions, ModelConfig,
                                      PerfConfig, RewardConfig, RolloutConfig)
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.envs import environment_spec
from lit_rlvr.models.lora import model_problems
from lit_rlvr.module import GRPOModule
from lit_rlvr.rewards import reward_problems

REPO = Path(__file__).resolve().parents[1]
SECTIONS = {AlgorithmConfig: "algorithm", ModelConfig: "model", RewardConfig: "reward", EngineConfig: "engine",
            EnvConfig: "env", PerfConfig: "perf", RolloutConfig: "rollout", DataConfig: "data"}


def _compose(*overrides: str):
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _one_line(err: pytest.ExceptionInfo, key: str) -> str:
    lines = err.value.problems if isinstance(err.value, ConfigError) else str(err.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{key}="), lines
    return lines[0]


def _scalar_fields():
    """(class, field) of every setting whose default is a number or a bool (the adversary's targets)."""
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            if isinstance(f.default, (int, float)) and not (cls is AlgorithmConfig and f.name in ("group_size",)):
                yield cls, f.name
    yield AlgorithmConfig, "group_size"


@pytest.mark.parametrize("cls,name", list(_scalar_fields()), ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("value", ["abc", math.nan, [1]], ids=["str", "nan", "list"])
def test_every_scalar_setting_refuses_a_value_of_another_kind_naming_its_key(cls, name, value):
    """A string, NaN or a list for any number or flag of any settings class: one line naming `section.name`."""
    with pytest.raises(ConfigError) as err:
        cls(**{name: value})
    _one_line(err, f"{SECTIONS[cls]}.{name}")


@pytest.mark.parametrize("cls,name", [(c, n) for c, n in _scalar_fields()
                                      if type(dataclasses.fields(c)[[f.name for f in dataclasses.fields(c)]
                                                                    .index(n)].default) is int])
def test_every_integer_setting_refuses_a_bool_and_a_fraction(cls, name):
    for value in (True, 2.5):
        with pytest.raises(ConfigError) as err:
            cls(**{name: value})
        _one_line(err, f"{SECTIONS[cls]}.{name}")


@pytest.mark.parametrize("override,key", [
    ("data.num_test=-1", "data.num_test"), ("data.num_train=0", "data.num_train"),
    ("data.eval_batch_size=0", "data.eval_batch_size"), ("data.split_seed=-1", "data.split_seed"),
    ("data.batch_size=-8", "data.batch_size"), ("data.levels=[]", "data.levels"),
    ("+data.max_prompt_chars=-3", "data.max_prompt_chars"), ("+data.eval_limit=0", "data.eval_limit"),
    ("+data.on_bad_row=ignore", "data.on_bad_row"), ("+data.format=csv", "data.format"),
    ("model.dtype=float33", "model.dtype"), ("model.lora.target_modules=5", "model.lora.target_modules"),
    ("model.lora.rank=1000000000", "model.lora.rank"), ("model.lora.rank=1000", "model.lora.rank"),
    ("model.options.lr=-1", "model.options.lr"), ("model.options.max_steps=0", "model.options.max_steps"),
    ("model.options.batch_size=0", "model.options.batch_size"), ("model.options.levels=[99]", "model.options.levels"),
    ("+model.options.hidden_size=12", "model.options.hidden_size"),
])
def test_train_py_names_each_key_before_any_work(override, key):
    with pytest.raises(ConfigError) as err:
        check_config(_compose(override))
    _one_line(err, key)


def test_a_lora_rank_above_the_models_width_is_refused_naming_it():
    """Rank 1e9 asked for 256 GB; rank 1000 on the 64-wide tiny model trained silently."""
    assert model_problems(LoraOptions(rank=1000), "tiny") == [
        "model.lora.rank=1000 is not valid: expected an integer <= 64, the model's width (hidden_size): a higher rank "
        "adds parameters, not expressiveness"]
    assert model_problems(LoraOptions(rank=64), "tiny") == []
    assert model_problems(LoraOptions(rank=128), "tiny", {"hidden_size": 128}) == []


def test_train_py_prints_one_line_for_a_negative_test_set(tmp_path):
    done = subprocess.run([sys.executable, "train.py", "data.num_test=-1", f"hydra.run.dir={tmp_path}"], cwd=REPO,
                          env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("config error:")] == [
        "config error: data.num_test=-1 is not valid: expected an integer >= 1"]
    assert not (tmp_path / "metrics.csv").exists()


def test_python_constructors_name_the_key():
    with pytest.raises(ConfigError) as err:
        RLVRDataModule(batch_size="4")
    assert _one_line(err, "data.batch_size") == (
        "data.batch_size='4' is not valid: expected an integer >= 1 (prompts per RL step, all ranks together)")
    with pytest.raises(ConfigError) as err:
        GRPOModule(reward=42)  # before the model loads
    _one_line(err, "reward.name")
    with pytest.raises(ConfigError) as err:
        GRPOModule(env=7)
    _one_line(err, "env.name")
    with pytest.raises(ValueError, match=r"^data.levels=\[99\] is not valid"):
        RLVRDataModule(levels=[99])  # the task's own levels: named when built, not when the data loads


def test_callbacks_name_their_keys():
    from lit_rlvr.callbacks import ValuePrior
    from lit_rlvr.callbacks.completions_log import CompletionsLog

    with pytest.raises(ConfigError) as err:
        CompletionsLog(samples="abc")
    _one_line(err, "callbacks.completions.samples")
    with pytest.raises(ConfigError) as err:
        CompletionsLog(every_n_steps=-1)
    _one_line(err, "callbacks.completions.every_n_steps")
    with pytest.raises(ValueError, match=r"^algorithm.callbacks.value_prior.max_length=0 must be >= 1"):
        ValuePrior(max_length=0)


def test_async_drop_with_no_staleness_is_refused():
    """drop runs S + 1 batches ahead: at S = 0 every batch arrives one version stale and is generated twice."""
    with pytest.raises(ConfigError) as err:
        RolloutConfig(mode="async", max_staleness=0, stale_strategy="drop")
    assert err.value.problems[0].startswith("rollout.stale_strategy=drop with rollout.max_staleness=0:")
    with pytest.raises(ConfigError, match=r"^rollout.stale_strategy=drop with rollout.max_staleness=0"):
        check_config(_compose("rollout.mode=async", "rollout.max_staleness=0", "rollout.stale_strategy=drop"))
    RolloutConfig(mode="async", max_staleness=1, stale_strategy="drop")
    RolloutConfig(mode="async", max_staleness=0, stale_strategy="wait")
    RolloutConfig(mode="sync", max_staleness=0, stale_strategy="drop")  # not used without async


def test_lora_options_without_a_rank_are_refused():
    """`model.lora.target_modules=[x]` without a rank was ignored (LoRA off, all weights trained)."""
    line = ("model.lora.target_modules set without model.lora.rank: LoRA is off (all weights train) until "
            "model.lora.rank=R is set (e.g. 16); set it, or leave model.lora unset")
    with pytest.raises(ConfigError) as err:
        LoraOptions(target_modules=["x"])
    assert err.value.problems == [line]
    with pytest.raises(ConfigError) as err:
        check_config(_compose("model.lora.target_modules=[x]"))
    assert err.value.problems == [line]
    with pytest.raises(ConfigError, match="model.lora.alpha, model.lora.dropout set without model.lora.rank"):
        LoraOptions(alpha=16, dropout=0.1)
    assert not LoraOptions().enabled and LoraOptions(rank=8, target_modules=["q_proj"]).enabled


def test_a_terms_unknown_option_is_named_with_its_path_before_the_model_loads():
    """It was named `reward.options [...]`, and only when the reward was built after the model had loaded."""
    terms = {"terms": {"math": {"weight": 1.0, "options": {"timeout_z": 1}}}}
    assert reward_problems("terms", terms) == [
        "reward.options.terms.math.options.timeout_z is not an option (did you mean "
        "reward.options.terms.math.options.timeout_s?); valid: float_rounding, format_weight, isolation, "
        "max_concurrent, score_bound, timeout_s, workers"]
    assert reward_problems("terms", {"terms": {"arithmetic": {"options": {"foo": 1}}}}) == [
        "reward.options.terms.arithmetic.options.foo is not an option: reward='arithmetic' is a function and takes "
        "none"]
    assert reward_problems("math", {"foo": 1})[0].startswith("reward.options.foo is not an option")
    with pytest.raises(ConfigError, match=r"^reward.options.terms.format.options.patern is not an option"):
        check_config(_compose("reward=arithmetic_format", "+reward.options.terms.format.options.patern=x"))
    assert reward_problems("terms", {"terms": {"math": {"options": {"timeout_s": 3}}}}) == []


def test_an_environment_without_defaults_fits_the_default_model():
    """A user's class with no `defaults` took `max_tokens` 256, which the 256-position default model cannot hold;
    the default is derived from the model's positions."""
    from fault_helpers import StallingEnv  # a TextEnv with no `defaults`

    assert not StallingEnv.defaults
    assert environment_spec(StallingEnv, {}, context=256).limits["max_tokens"] == 128
    assert environment_spec(StallingEnv, {}, context=32768).limits["max_tokens"] == 256
    assert environment_spec(StallingEnv, {}).limits["max_tokens"] == 256  # context unknown: Environment's
    assert environment_spec(StallingEnv, {"max_tokens": 64}, context=256).limits["max_tokens"] == 64
    check_config(_compose("env=retry", "env.name=fault_helpers:StallingEnv", "env.options={}"))
