"""Checkpoint writes (issue 19, point 11): `AtomicCheckpointIO` writes in the target directory, never in
$TMPDIR, and a process killed (SIGKILL) in the middle of a save leaves the previous `last.ckpt` intact and no
partial file anywhere."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lit_rlvr.run import checkpoint_io
from lit_rlvr.run.checkpoint_io import atomic_save, sweep_temp_files

REPO = Path(__file__).resolve().parents[1]

# a Lightning run of a 128 MB model that saves every step; at step 2's save a thread SIGKILLs the process once it
# has written 32 MB more than before the save (/proc/self/io wchar): mid-write, whatever the save path
CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    import lightning.pytorch as pl
    import torch
    from lit_rlvr.run.run_checkpoint import RunCheckpoint

    def written():
        return int(next(l for l in open("/proc/self/io") if l.startswith("wchar")).split()[1])

    def kill_after(extra):
        start = written()
        while written() < start + extra:
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)

    class Big(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(32, 1024, 1024))
        def training_step(self, batch, batch_idx):
            return self.w[0, 0, 0] * batch.sum()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.ones(8, 1), batch_size=1)

    class KillMidSave(pl.Callback):
        def on_train_batch_end(self, trainer, *args):  # after RunCheckpoint saved step 1
            if trainer.global_step == 1:
                threading.Thread(target=kill_after, args=(32 << 20,), daemon=True).start()

    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[RunCheckpoint(sys.argv[1], every_n_steps=1), KillMidSave()])
    trainer.fit(Big())
""")


def report(**record) -> None:
    if os.environ.get("FAULT_REPORT"):
        with open(os.environ["FAULT_REPORT"], "a") as handle:
            handle.write(json.dumps(record) + "\n")


def test_sigkill_mid_save_leaves_previous_checkpoint_and_no_partial_file(tmp_path):
    checkpoints, tmpdir = tmp_path / "checkpoints", tmp_path / "tmpdir"
    tmpdir.mkdir()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(checkpoints)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmpdir)}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
    assert list(tmpdir.iterdir()) == []  # nothing written to $TMPDIR either
    assert torch.load(checkpoints / "last.ckpt", weights_only=False, mmap=True)["global_step"] == 1
    report(fault="SIGKILL mid-save of last.ckpt", bad_inputs=1, survived=False, stopped_cleanly=True, data_lost=0)


@pytest.mark.parametrize("unnamed", [True, False], ids=["O_TMPFILE", "named-temp"])
def test_failed_save_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch, unnamed):
    if not unnamed:
        monkeypatch.setattr(checkpoint_io, "_open_unnamed", lambda directory: None)
    path = tmp_path / "last.ckpt"
    atomic_save({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_save({"big": torch.zeros(1000), "bad": Unpicklable()}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert torch.load(path)["step"] == 1
    atomic_save({"step": 2}, path)
    assert torch.load(path)["step"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_sweep_removes_temp_files_left_by_a_kill(tmp_path):
    path = tmp_path / "last.ckpt"
    (tmp_path / ".last.ckpt.1234.tmp").write_bytes(b"partial")
    path.write_bytes(b"keep")
    sweep_temp_files(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
