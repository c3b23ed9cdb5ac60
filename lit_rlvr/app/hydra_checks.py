"""`RunDirCheck`: a Hydra callback (conf/config.yaml `hydra.callbacks`) that checks the run directory can be
written before Hydra creates it, opens its log file and saves `.hydra/` in it: a read-only or full directory,
or a path through a file, is one line naming `hydra.run.dir` (`hydra.sweep.dir` with -m), not two tracebacks
from inside Hydra's logging setup. A run dir another run holds or held is refused there too (lit_rlvr/run/run_lock.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.run.one_line import config_phase, one_line_errors
from lit_rlvr.run.run_lock import earlier_run, hold_run_dir
from lit_rlvr.run.storage import check_writable_dir


def resume_setting(cfg: DictConfig) -> tuple[Optional[str], Optional[str]]:
    """(the setting that continues a run in its own directory, the checkpoint it names): `resume` and its value for
    a training run, (None, None) for an evaluation (it continues nothing)."""
    return ("resume", cfg.get("resume")) if cfg.get("mode") == "train" else (None, None)


class RunDirCheck(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        path = self._check(config, "hydra.run.dir")
        with one_line_errors():  # before Hydra's log file and `.hydra/` are written there (a sweep's jobs: entry.py)
            hold_run_dir(path, "hydra.run.dir", *resume_setting(config))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        path = self._check(config, "hydra.sweep.dir")
        jobs = sorted(job.name for job in path.iterdir() if job.is_dir() and earlier_run(job)) if path.is_dir() else []
        if jobs and resume_setting(config)[1] is None:  # before Hydra rewrites multirun.yaml and each job's .hydra/
            with one_line_errors(), config_phase():
                raise ConfigError([f"hydra.sweep.dir={str(path)!r} holds an earlier sweep's runs (jobs "
                                   f"{', '.join(jobs[:5])}{', ...' if len(jobs) > 5 else ''}), which this sweep would "
                                   "overwrite: pass hydra.sweep.dir=ANOTHER_DIR"])

    def _check(self, config: DictConfig, key: str) -> Path:
        HydraConfig.instance().set_config(config)  # as Hydra does next: the dir may refer to ${hydra:...}
        path = Path(str(OmegaConf.select(config, key))).absolute()
        with one_line_errors(), config_phase():
            check_writable_dir(path, key)
        return path
