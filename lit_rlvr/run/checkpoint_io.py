"""`AtomicCheckpointIO`: checkpoint files written in place of Lightning's default `TorchCheckpointIO` save.

Lightning's save pickles the whole checkpoint into memory (RAM rises by the checkpoint's size), then fsspec
writes it to a temp file in `$TMPDIR` and moves it: a kill mid-write leaves a partial file there, a `$TMPDIR`
smaller than one checkpoint fails every save, and nothing is fsynced. Here `torch.save` streams into a file in
the target directory that has no name until it is complete (Linux `O_TMPFILE`; a kill at any point leaves
nothing), which is fsynced, linked under a hidden temp name, renamed over the target (atomic), and the
directory is fsynced. Where `O_TMPFILE` is not supported, a named hidden temp file is used instead and a later
save sweeps up one left by a kill (`sweep_temp_files`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lit_rlvr.run.storage import tensor_bytes, writing

UNSUPPORTED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT)  # O_TMPFILE missing on this fs/kernel


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def sweep_temp_files(path: Path) -> None:
    """Removes temp files of `path` left by a process killed mid-save (only the named fallback leaves them)."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def _open_unnamed(directory: Path) -> Optional[int]:
    if not hasattr(os, "O_TMPFILE") or not Path("/proc/self/fd").is_dir():
        return None
    try:
        return os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o644)
    except OSError as err:
        if err.errno in UNSUPPORTED:
            return None
        raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_fd(fd: int, target: Path) -> None:
    """linkat(/proc/self/fd/N, target, AT_SYMLINK_FOLLOW). A dir fd is passed so that Python calls linkat:
    its plain link() would link the /proc symlink itself."""
    proc = os.open("/proc/self/fd", os.O_RDONLY)
    try:
        os.link(str(fd), target, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def atomic_save(obj: Any, path: Path) -> None:
    """`torch.save(obj)` to `path`: complete and durable, or not there at all (the old file stays). A full disk
    (or an unwritable directory) is a one-line `StorageError` naming the file, the bytes needed and free."""
    path = Path(path)
    hint = (f"Nothing saved is lost: the previous {path.name} is intact (continue with resume={path})"
            if path.exists() else "No checkpoint was saved before this one")
    with writing(path, "the checkpoint", needed=tensor_bytes(obj), hint=hint):
        _atomic_save(obj, path)


def _atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    fd = _open_unnamed(path.parent)
    unnamed = fd is not None
    if not unnamed:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)  # streams tensor by tensor: no in-memory copy of the checkpoint
            handle.flush()
            os.fsync(handle.fileno())
            if unnamed:  # give the complete file a name (linkat cannot replace a file: the rename below does)
                tmp.unlink(missing_ok=True)
                _link_fd(handle.fileno(), tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning `CheckpointIO` whose saves are `atomic_save` (loads and removals are Lightning's)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_save(checkpoint, Path(path))


def checkpoint_hint(trainer: Any) -> str:
    """What a stopped run keeps: the last checkpoint, if one was written (never claim one that is not there)."""
    callbacks = trainer.callbacks if trainer is not None else []
    path = next((cb.last_path for cb in callbacks if hasattr(cb, "last_path")), None)
    if path is not None and Path(path).exists():
        return f"the last checkpoint {path} is intact: fix the cause and continue with resume={path}"
    return "no checkpoint was written yet (the run stopped before its first save): fix the cause and start again"
