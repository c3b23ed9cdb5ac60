"""Hydra entry point: `python train.py [overrides]` (see README and conf/config.yaml)."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from lit_rlvr.app.entry import check_command_line, run  # lit_rlvr first: it sets OMP_WAIT_POLICY before torch loads


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)  # the same as `lit-rlvr-train` (lit_rlvr/app/entry.py)


if __name__ == "__main__":
    check_command_line(str(Path(__file__).resolve().parent / "conf"))  # typed settings' errors as one line
    main()
