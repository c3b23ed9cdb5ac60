"""`ClosePipeline`: the rollout source's producer stopped when fit ends by an exception."""

from __future__ import annotations

import lightning.pytorch as pl

from lit_rlvr.config.errors import StopRequested
from lit_rlvr.run.stop import STOP


class ClosePipeline(pl.Callback):
    """Closes the module's rollout source (`lit_rlvr.rollout.source`) when fit ends by an exception (Lightning then
    skips the module's `teardown`): an async producer's thread must not be inside an engine call when the process
    exits. `GRPOModule.configure_callbacks` adds it."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if pl_module.source is not None:
            pl_module.source.close()
        if isinstance(exception, StopRequested):  # after a stop past its grace the producer's waits gave up too
            STOP.arm(None)  # (`RunCheckpoint` left the flag raised for that)
