"""The progress bar of an RL run: steps, not epochs (a run is bounded by `trainer.max_steps`)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class RLProgressBar(RichProgressBar):
    """Rich's bar without "Epoch 0/-2" (with `max_epochs=-1` Lightning writes the bound as max_epochs - 1), counting
    the batches that made an update: with `rollout.mode=async` the first S calls only fill the pipeline (no update),
    and a bar of batches read `66/2` at the second update of a run with S = 64."""

    _stepped_at_start = 0  # the run's batches that stepped when this epoch (or its resume) began

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        text = f"RL step (max_steps={self.trainer.max_steps})"
        return f"{text:{len(self.validation_description)}}"

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stepped_at_start = trainer.fit_loop.epoch_loop._batches_that_stepped
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning counts this batch after the hook (less one where the module found no update: a filling call)
        updates = trainer.fit_loop.epoch_loop._batches_that_stepped + 1 - self._stepped_at_start
        super().on_train_batch_end(trainer, pl_module, outputs, batch, updates - 1)  # the bar shows batch_idx + 1
