"""Variants compose as config values (issue 40): GSPO's loss with the rollout correction's token weights, and
DAPO's dynamic sampling with GSPO's loss, each a short in-process `train.py` run on the tiny model."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lit_rlvr.recipe import train

CONF = Path(__file__).resolve().parents[1] / "conf"


def run(tmp_path: Path, tiny_path: str, *overrides: str) -> tuple[dict, list[dict]]:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[
            f"model.name_or_path={tiny_path}", f"hydra.run.dir={tmp_path}", "trainer.max_steps=3",
            "data.batch_size=2", "data.num_test=2", "eval_before=false", "callbacks.progress=null",
            "algorithm.group_size=4", "algorithm.max_new_tokens=6", *overrides])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = cfg.hydra.run.dir
    HydraConfig.instance().set_config(cfg)
    summary = train(cfg, tmp_path)
    rows = [r for r in csv.DictReader((tmp_path / "metrics.csv").open()) if r.get("loss/policy")]  # RL steps
    return summary, rows


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
