"""`rollout.mode=async` composes with the algorithms, the decoupled objective, LoRA and environments, or is refused in
one line before the model loads, saying why (docs/async.md). Short in-process `train.py` runs on the tiny model with
the HF engine; the SGLang and vLLM engines run async in the live stages."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from recipe_runs import train_in_process

from lit_rlvr.config.errors import ConfigError

ASYNC = ("rollout.mode=async", "rollout.max_staleness=1")


def run(tmp_path: Path, tiny_path: str, *overrides: str) -> tuple[dict, list[dict]]:
    return train_in_process(tmp_path, [
        f"model.name_or_path={tiny_path}", "trainer.max_steps=3", "data.batch_size=2", "data.num_test=2",
        "eval_before=false", "callbacks.progress=null", "algorithm.group_size=4", "algorithm.max_new_tokens=6",
        *ASYNC, *overrides])


@pytest.mark.parametrize("overrides, column", [
    (("algorithm=grpo",), "loss/policy"),
    (("algorithm=dr_grpo",), "loss/policy"),
    (("algorithm=gspo",), "loss/policy"),
    (("algorithm=dapo", "algorithm.filter_groups.enable=false"), "loss/policy"),
    (("algorithm.rollout_correction.rollout_is=token",), "mismatch/is_clip_frac"),  # AReaL's decoupled objective
    (("model.lora.rank=4",), "loss/policy"),
    (("model.lora.rank=4", "engine.options.lora_sync=merged"), "loss/policy"),
    (("env=calculator", "algorithm.max_new_tokens=8"), "env/turns_mean"),
], ids=["grpo", "dr_grpo", "gspo", "dapo-no-filter", "decoupled", "lora-adapter", "lora-merged", "calculator"])
def test_async_composes(overrides, column, tiny_path, tmp_path):
    summary, rows = run(tmp_path, tiny_path, *overrides)
    assert len(rows) >= 2 and summary["optimizer_steps"] >= 3  # GSPO: 2 optimizer steps an update
    assert [float(r["async/staleness_max"]) for r in rows] == [0.0] + [1.0] * (len(rows) - 1)  # in updates
    for row in rows:
        assert math.isfinite(float(row["loss/policy"])) and row[column] != ""
        assert 0 <= float(row["async/trainer_wait_frac"]) <= 1


@pytest.mark.parametrize("overrides, says", [
    (("algorithm=c3po",), "ParamNoise"), (("algorithm=b3po",), "ParamNoise"),
    (("algorithm=m3po", "algorithm.callbacks.param_noise.num_samples=2"), "ParamNoise"),
    (("algorithm=v05",), "ValuePrior"), (("algorithm=dapo",), "filter_groups"),
    (("algorithm.rollout_correction.bypass_mode=false",), "would not correct for the lag"),
    (("engine.options.mode=shared",), "needs its own copy"),
], ids=["c3po", "b3po", "m3po", "v05", "dapo", "no-correction", "shared-engine"])
def test_async_refusals_say_why(overrides, says, tiny_path, tmp_path):
    with pytest.raises(ConfigError, match=says) as caught:
        run(tmp_path, tiny_path, *overrides)
    assert "\n" not in str(caught.value) and "rollout.mode=async" in str(caught.value)
