"""Every algorithm trains on multi-turn rollouts: a short `train.py` run per algorithm (and engine mode) with
`env=retry` on the default task, where the warm-started tiny model's wrong answers get another turn. The live
engines (vLLM, SGLang) run the same loop in their own tests (tests/test_vllm_live.py, tests/live_sglang/)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from recipe_runs import train_in_process

ALGORITHMS = ["grpo", "dapo", "dr_grpo", "gspo", "b3po", "m3po", "c3po", "v05", "c3po_v05"]


def run(tmp_path: Path, tiny_path: str, *overrides: str) -> tuple[dict, list[dict]]:
    return train_in_process(tmp_path, [
        "env=retry", f"model.name_or_path={tiny_path}", "trainer.max_steps=1",
        "data.batch_size=2", "data.num_test=4", "eval_before=false", "callbacks.progress=null",
        "callbacks.completions.every_n_steps=1", "algorithm.max_new_tokens=6", "env.max_tokens=48", *overrides])


# with the other capabilities: an engine with its own weights, LoRA adapters (pushed to a copy engine: C3PO's sampled
# adapters through every turn), the rollout correction's decoupled π_old forward over observation-bearing rows
COMPOSED = {"grpo-copy-engine": ("grpo", ("engine.options.mode=copy",)),
            "grpo-lora": ("grpo", ("model.lora.rank=4",)),
            "c3po-lora-copy-engine": ("c3po", ("model.lora.rank=4", "engine.options.mode=copy")),
            "grpo-rollout-correction": ("grpo", ("engine.options.mode=copy", "engine.options.dtype=bfloat16",
                                                  "algorithm.rollout_correction.rollout_is=token"))}


@pytest.mark.parametrize("algorithm, extra", [(a, ()) for a in ALGORITHMS] + list(COMPOSED.values()),
                         ids=ALGORITHMS + list(COMPOSED))
def test_every_algorithm_trains_on_multi_turn_rollouts(algorithm, extra, tiny_path, tmp_path):
    group = {"m3po": 8, "c3po": 8, "c3po_v05": 8}.get(algorithm, 4)
    summary, rows = run(tmp_path, tiny_path, f"algorithm={algorithm}", f"algorithm.group_size={group}", *extra)
    assert summary["steps"] == 1 and len(rows) == 1
    for row in rows:
        assert float(row["env/turns_mean"]) > 1  # wrong answers were retried
        assert 0 < float(row["env/obs_token_frac"]) < 1 and float(row["env/tool_errors"]) == 0
        assert math.isfinite(float(row["loss/policy"])) and float(row["train/skipped_steps"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    roles = {turn["role"] for line in lines for turn in line["turns"]}
    assert roles == {"assistant", "observation"} and all(line["turns"][0]["role"] == "assistant" for line in lines)
    assert summary["accuracy_after"] is not None
