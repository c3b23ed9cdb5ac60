"""The Hydra recipe's entry: `python train.py` in a clone and `lit-rlvr-train` after `pip install` run `run`.

`lit-rlvr-train` reads the configs shipped in the package (`lit_rlvr.conf`, the clone's `conf/` folder), so it
works from any directory; overrides are the same as train.py's. Config errors (a wrong type, a value out of
range, a missing file named by a key, a constructor's check) and files that cannot be written (a full disk, a
read-only directory) print one line and exit with code 2 (lit_rlvr/run/one_line.py); LIT_RLVR_DEBUG=1 shows the
traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lit_rlvr.config.config_check import check_config
from lit_rlvr.recipe import check_run_dir, evaluate, print_summary, train
from lit_rlvr.run import quiet
from lit_rlvr.run.distributed import shutdown
from lit_rlvr.run.one_line import config_phase, one_line_errors


def run(cfg: DictConfig) -> None:
    """Check the config, then train or evaluate as `cfg.mode` says."""
    with one_line_errors():
        _run(cfg)


def _run(cfg: DictConfig) -> None:
    with config_phase():
        check_config(cfg)
        check_run_dir(HydraConfig.get())
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    quiet.install(run_dir, cfg.resume)
    if cfg.mode == "train":
        print_summary(train(cfg, run_dir), f"lit-rlvr {cfg.algorithm.name} run ({run_dir})")
    else:
        print_summary(evaluate(cfg, run_dir), f"lit-rlvr eval ({run_dir})")
    shutdown()  # torchrun: close the process group before exit


@hydra.main(config_path="pkg://lit_rlvr.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Console script `lit-rlvr-train [overrides]`."""
    run(cfg)


def console() -> None:
    """`lit-rlvr-train`: like `python -m`, the current directory is importable (reward.name=my_module:fn)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    main()


if __name__ == "__main__":
    main()
