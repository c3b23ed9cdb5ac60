"""Hydra entry point: `python train.py [overrides]` (see README and conf/config.yaml)."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lit_rlvr.distributed import shutdown
from lit_rlvr.recipe import check_run_dir, evaluate, print_summary, train  # lit_rlvr first: it sets OMP_WAIT_POLICY before torch loads


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    check_run_dir(HydraConfig.get())
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.mode == "train":
        print_summary(train(cfg, run_dir), f"lit-rlvr {cfg.algorithm.name} run ({run_dir})")
    elif cfg.mode == "eval":
        print_summary(evaluate(cfg, run_dir), f"lit-rlvr eval ({run_dir})")
    else:
        raise ValueError(f"mode={cfg.mode!r} is not valid; valid: train, eval")
    shutdown()  # torchrun: close the process group before exit


if __name__ == "__main__":
    main()
