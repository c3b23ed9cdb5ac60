"""`RunCheckpoint`: `checkpoints/last.ckpt`, written atomically every `every_n_steps` optimizer steps, at the
run's last step, and at the step during which SIGTERM or a first SIGINT (Ctrl-C) arrived (then training stops;
docs/architecture.md §10). A step that has not ended `stop_grace_s` seconds after the signal is abandoned
(`lit_rlvr.run.stop`: nothing of it is saved; the recipe names the intact last.ckpt). A second SIGINT aborts at once.
With LoRA the module's `AdapterExport` writes the adapter beside it in PEFT's format (`adapter/`), as it does for any
other save.

Why not `ModelCheckpoint` plus a save after `fit`: a checkpoint written after `fit` returns records the epoch as
finished, so a resumed run would start a new epoch (a new data order) instead of continuing the old one; and a
crash while writing must not leave a truncated `last.ckpt`: a file is written by `AtomicCheckpointIO` (an
unnamed temp file in the target directory, fsync, atomic rename, directory fsync), a sharded checkpoint (a
folder) aside and renamed over.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Union

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lit_rlvr.config.errors import ConfigError, StopRequested
from lit_rlvr.config.options import range_problems
from lit_rlvr.run.checkpoint_io import AtomicCheckpointIO, sweep_temp_files
from lit_rlvr.run.stop import STOP
from lit_rlvr.run.storage import writing

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # clusters allow ~30 s between SIGTERM and SIGKILL (SLURM's KillWait, Kubernetes' grace)


class RunCheckpoint(pl.Callback):
    """Args: `dirpath` folder of `last.ckpt`; `every_n_steps` optimizer steps between saves (>= 1); `stop_grace_s`
    seconds a step may still take after SIGTERM or Ctrl-C before it is abandoned (a run of one process)."""

    FILE = "last.ckpt"
    ASIDE = ".old"  # suffix of the previous sharded checkpoint while a new one is renamed in (`_replace`)

    def __init__(self, dirpath: Union[str, Path], every_n_steps: int, stop_grace_s: float = STOP_GRACE_S):
        if every_n_steps < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {every_n_steps}")
        problems = range_problems({"stop_grace_s": stop_grace_s}, "")
        ConfigError.check(problems)
        self.dirpath, self.every_n_steps, self.stop_grace_s = Path(dirpath), every_n_steps, float(stop_grace_s)
        self.saved_step = -1  # global step of the last save
        self.stopped_by_sigterm = False
        self.stopped_by_sigint = False
        self._sigint = False
        self._previous_sigint = None
        self._previous_sigterm = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: saves via $TMPDIR
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if trainer.is_global_zero:
            sweep_temp_files(self.last_path)  # left by a process killed mid-save (named temp files only)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # several ranks stop at a step's end only: a rank that abandoned a step would leave the others waiting
        STOP.arm(self.stop_grace_s if trainer.world_size == 1 else None)
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
            # Lightning adds its own SIGTERM handler after this hook and calls this one too
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # a step abandoned by a stop request: the flag stays raised, so the run's other threads (the async producer)
        # give up their waits too; `ClosePipeline` lowers it once they have
        self._restore_handlers(disarm=not isinstance(exception, StopRequested))

    def _restore_handlers(self, disarm: bool = True) -> None:
        if disarm:
            STOP.arm(None)
        for signum, previous in ((signal.SIGINT, self._previous_sigint), (signal.SIGTERM, self._previous_sigterm)):
            if previous is not None:
                signal.signal(signum, previous)
        self._previous_sigint = self._previous_sigterm = None

    def _on_sigint(self, signum, frame) -> None:
        self._sigint = True
        STOP.request("SIGINT")
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts at once
        log.warning("SIGINT: finishing this step (at most stop_grace_s=%gs more), saving last.ckpt and stopping "
                    "(Ctrl-C again to abort)", self.stop_grace_s)

    def _on_sigterm(self, signum, frame) -> None:
        STOP.request("SIGTERM")
        if callable(self._previous_sigterm):
            self._previous_sigterm(signum, frame)

    @property
    def last_path(self) -> Path:
        return self.dirpath / self.FILE

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # any rank's signal stops every rank at this step: a rank that stopped alone would leave the others
        # waiting in the next step's collectives (signals reach ranks at slightly different times)
        sigterm = trainer.strategy.reduce_boolean_decision(trainer.received_sigterm, all=False)
        sigint = trainer.strategy.reduce_boolean_decision(self._sigint, all=False)
        if (sigterm or sigint) and not trainer.should_stop:
            # Lightning's own handler would raise at the next batch; stopping here ends `fit` normally
            self.stopped_by_sigterm, self.stopped_by_sigint = sigterm, not sigterm
            trainer.should_stop = True
            name = "SIGTERM" if sigterm else "SIGINT"
            log.warning("%s at step %d: saving %s and stopping", name, trainer.global_step, self.last_path)
        step = trainer.global_step
        last = 0 < trainer.max_steps <= step
        if step % self.every_n_steps == 0 or last or trainer.should_stop:
            self.save(trainer)

    def save(self, trainer: pl.Trainer) -> None:
        """Write `last.ckpt` so that a crash or kill mid-write leaves the old one intact and no partial file."""
        # rank 0's view of the file decides for all: saving is a collective, every rank must take the same branch
        if self.saved_step == trainer.global_step and trainer.strategy.broadcast(self.last_path.exists()):
            return
        if getattr(trainer.strategy, "_save_distributed_checkpoint", False):  # a folder, one file per rank
            tmp = self.last_path.with_name(self.FILE + ".tmp")
            with writing(tmp, "the sharded checkpoint", hint=f"Nothing saved is lost: {self.last_path} is as it was"):
                trainer.save_checkpoint(tmp, weights_only=False)
            if trainer.is_global_zero:
                _replace(tmp, self.last_path)
        else:  # one file, through the strategy's checkpoint IO (AtomicCheckpointIO unless a user set another)
            trainer.save_checkpoint(self.last_path, weights_only=False)  # the full state (unset logs a line per save)
        trainer.strategy.barrier("RunCheckpoint.save")
        self.saved_step = trainer.global_step

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"saved_step": self.saved_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_step = int(state_dict.get("saved_step", -1))


def _replace(new: Path, old: Path) -> None:
    """Put `new` where `old` is. A file is renamed over atomically; a sharded checkpoint is a folder, which
    cannot be renamed over a non-empty one: the old folder is moved aside first and removed last."""
    if not new.is_dir() or not old.exists():
        os.replace(new, old)
        return
    aside = old.with_name(old.name + RunCheckpoint.ASIDE)
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(old, aside)
    os.replace(new, old)
    shutil.rmtree(aside, ignore_errors=True)
