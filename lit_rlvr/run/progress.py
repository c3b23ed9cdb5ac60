"""The progress bar of an RL run: steps, not epochs (a run is bounded by `trainer.max_steps`)."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class RLProgressBar(RichProgressBar):
    """Rich's bar without "Epoch 0/-2": with `max_epochs=-1` Lightning writes the bound as max_epochs - 1."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        text = f"RL step (max_steps={self.trainer.max_steps})"
        return f"{text:{len(self.validation_description)}}"
