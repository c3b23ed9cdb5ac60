"""`CSVLogger`: Lightning's CSV logger (metrics.csv, hparams.yaml) with writes that lose nothing on a full disk.

Lightning's writer appends rows, but rewrites metrics.csv in place when a new column appears (a failure halfway
loses the earlier rows) and reports ENOSPC without the file's name. Here a new header is written to a temp file
and renamed over, an append that fails is cut off again, the rows stay in memory until they are on disk, and a
failure is a one-line `StorageError` naming the file (lit_rlvr/run/storage.py). A remote (fsspec) log dir keeps
Lightning's own writer.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

from lit_rlvr.run.storage import append_text, write_atomic, writing


class SafeExperimentWriter(ExperimentWriter):
    """Metrics rows to metrics.csv and hyperparameters to hparams.yaml, each write whole or not at all."""

    @override
    def save(self) -> None:
        if not self.metrics:
            return
        keys = sorted(set(self.metrics_keys).union(*self.metrics))
        exists = os.path.isfile(self.metrics_file_path)
        if exists and keys != self.metrics_keys:  # a new column: the whole file again, under a new header
            with open(self.metrics_file_path, newline="") as handle:
                rows = list(csv.DictReader(handle)) + self.metrics
            write_atomic(self.metrics_file_path, _csv(keys, rows, header=True), "the metrics file")
        else:
            append_text(self.metrics_file_path, _csv(keys, self.metrics, header=not exists), "the metrics file")
        self.metrics_keys, self.metrics = keys, []  # only once they are on disk: a failed save keeps them

    @override
    def log_hparams(self, params: dict[str, Any]) -> None:
        with writing(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), "the hyperparameters file"):
            super().log_hparams(params)


def _csv(keys: list[str], rows: list[dict[str, Any]], header: bool) -> str:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=keys)
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


class CSVLogger(LightningCSVLogger):
    """`lightning.pytorch.loggers.CSVLogger` (same arguments and files) whose writer is `SafeExperimentWriter`."""

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None and _is_local_file_protocol(self.root_dir):
            with writing(self.log_dir, "the log directory"):
                self._fs.makedirs(self.root_dir, exist_ok=True)
                self._experiment = SafeExperimentWriter(log_dir=self.log_dir)
        return super().experiment
