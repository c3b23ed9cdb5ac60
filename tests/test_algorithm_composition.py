"""Variants compose as config values (issue 40): GSPO's loss with the rollout correction's token weights, and
DAPO's dynamic sampling with GSPO's loss, each a short in-process `train.py` run on the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from recipe_runs import train_in_process

def run(tmp_path: Path, tiny_path: str, *overrides: str) -> tuple[dict, list[dict]]:
    return train_in_process(tmp_path, [
        f"model.name_or_path={tiny_path}", "trainer.max_steps=3",
        "data.batch_size=2", "data.num_test=2", "eval_before=false", "callbacks.progress=null",
        "algorithm.group_size=4", "algorithm.max_new_tokens=6", *overrides])


@pytest.mark.parametrize("overrides, column", [
    (("algorithm=gspo", "algorithm.rollout_correction.rollout_is=token"), "mismatch/is_clip_frac"),
    (("algorithm=dapo", "algorithm.policy_loss=gspo", "algorithm.filter_groups.max_num_gen_batches=0"),
     "dapo/kept_groups"),
], ids=["gspo-rollout-is", "dapo-gspo"])
def test_gspo_composes_with_the_rollout_correction_and_dapos_sampling(overrides, column, tiny_path, tmp_path):
    summary, rows = run(tmp_path, tiny_path, *overrides)
    assert rows and summary["steps"] == len(rows)  # GSPO: 2 mini-batches, so 3 optimizer steps end in RL step 2
    for row in rows:
        assert math.isfinite(float(row["loss/policy"])) and float(row["train/skipped_steps"]) == 0
        assert row[column] != ""  # the correction's weights, or the filter's kept groups, were in the step
