"""`train.py`'s recipe run in the test's own process (no interpreter start-up per run): compose the Hydra config
with the given overrides, run it in `run_dir`, and return the summary and the RL steps' rows of metrics.csv."""

from __future__ import annotations

import csv
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lit_rlvr.app.recipe import train

CONF = Path(__file__).resolve().parents[1] / "conf"


def train_in_process(run_dir: Path, overrides: list[str]) -> tuple[dict, list[dict]]:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[f"hydra.run.dir={run_dir}", *overrides])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = cfg.hydra.run.dir
    HydraConfig.instance().set_config(cfg)
    summary = train(cfg, run_dir)
    rows = [r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("loss/policy")]  # RL steps
    return summary, rows
