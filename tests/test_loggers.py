"""`logger=tensorboard` and `logger=wandb` (offline): the shipped configs instantiate and write their files."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
from tiny_options import TINY as TINY_OPTIONS

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = {"cache_dir": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr"), **TINY_OPTIONS}  # = conf/model/tiny.yaml


def loggers_of(name: str, run_dir: Path) -> list:
    """Instantiate conf/logger/<name>.yaml as train.py does, with the run dir in place of Hydra's."""
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.recipe import _keyed

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"logger={name}"])
    for node in cfg.logger.values():
        node.save_dir = str(run_dir)
    return _keyed(cfg.logger)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-step fit of the tiny GRPO with the loggers of logger=tensorboard and logger=wandb."""
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    from lit_rlvr.data.datamodule import RLVRDataModule
    from lit_rlvr.module import GRPOModule

    run_dir = tmp_path_factory.mktemp("loggers")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    loggers = loggers_of("tensorboard", run_dir) + [lg for lg in loggers_of("wandb", run_dir)
                                                    if type(lg).__name__ == "WandbLogger"]
    assert [type(lg).__name__ for lg in loggers] == ["CSVLogger", "TensorBoardLogger", "WandbLogger"]
    pl.seed_everything(0, verbose=False)
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=8)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=loggers, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=str(run_dir))
    try:
        trainer.fit(module, datamodule=RLVRDataModule(batch_size=4, seed=0))
    finally:
        wandb.finish()
        mp.undo()
    return run_dir


def test_csv_metrics(run):
    text = (run / "metrics.csv").read_text()
    assert "reward/mean" in text.splitlines()[0] and len(text.splitlines()) == 3  # header + 2 steps


def test_tensorboard_event_files(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events, f"no event file under {run / 'tensorboard'}"
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert {"reward/mean", "grad/norm", "groups/zero_adv_frac"} <= set(tags)
    assert [e.step for e in accumulator.Scalars("reward/mean")] == [0, 1]


def test_wandb_offline_run_files(run):
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run / "wandb").iterdir()) if (run / "wandb").exists() else "no wandb dir"
    records = list(runs[0].glob("run-*.wandb"))
    assert records and records[0].stat().st_size > 0
    data = records[0].read_bytes()  # the run's protobuf record log, what `wandb sync` uploads
    assert b"reward/mean" in data and b"grad/norm" in data
