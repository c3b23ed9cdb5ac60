"""`ClosePipeline`: the async producer stopped when fit ends by an exception."""

from __future__ import annotations

import lightning.pytorch as pl

from lit_rlvr.config.errors import StopRequested
from lit_rlvr.run.stop import STOP


class ClosePipeline(pl.Callback):
    """Calls the module's `close_pipeline` when fit ends by an exception (Lightning then skips the module's
    `teardown`): the producer's thread must not be inside an engine call when the process exits.
    `GRPOModule.configure_callbacks` adds it."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        pl_module.close_pipeline()  # after a stop request past its grace, the producer's waits give up too
        if isinstance(exception, StopRequested):  # (`RunCheckpoint` left the flag raised for that)
            STOP.arm(None)
