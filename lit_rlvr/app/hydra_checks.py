"""`RunDirCheck`: a Hydra callback (conf/config.yaml `hydra.callbacks`) that checks the run directory can be
written before Hydra creates it, opens its log file and saves `.hydra/` in it: a read-only or full directory,
or a path through a file, is one line naming `hydra.run.dir` (`hydra.sweep.dir` with -m), not two tracebacks
from inside Hydra's logging setup. A run dir another run holds or held is refused there too (lit_rlvr/run/run_lock.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lit_rlvr.run.one_line import config_phase, one_line_errors
from lit_rlvr.run.run_lock import hold_run_dir
from lit_rlvr.run.storage import check_writable_dir


def continues_a_run(cfg: DictConfig) -> bool:
    """A training run with `resume=` set continues the run whose directory it may be given."""
    return cfg.get("mode") == "train" and cfg.get("resume") is not None


class RunDirCheck(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        path = self._check(config, "hydra.run.dir")
        with one_line_errors():  # before Hydra's log file and `.hydra/` are written there (a sweep's jobs: entry.py)
            hold_run_dir(path, "hydra.run.dir", "resume", continues_a_run(config))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    def _check(self, config: DictConfig, key: str) -> Path:
        HydraConfig.instance().set_config(config)  # as Hydra does next: the dir may refer to ${hydra:...}
        path = Path(str(OmegaConf.select(config, key))).absolute()
        with one_line_errors(), config_phase():
            check_writable_dir(path, key)
        return path
