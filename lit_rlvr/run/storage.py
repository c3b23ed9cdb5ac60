"""Files of a run written so that a full disk (or a quota, a read-only or unwritable directory) loses nothing
already saved and ends in one line naming the cause, the path, and the bytes needed and free where known.

`writing(path, what)` turns such a failure, however deep in a library it surfaced (torch's zip writer reports
ENOSPC as "unexpected pos", safetensors as its own error), into a `StorageError` whose message is that line;
`write_atomic` (a temp file in the same directory, fsync, rename: the old file stays until the new one is whole)
and `append_text` (a failed append is cut back off) use it.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from lit_rlvr.config.errors import StorageError, debug

# errno -> the words the OS uses; the causes that a user fixes on the machine, not in the code
STORAGE_ERRNOS = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
                  errno.EFBIG: "File too large", errno.EROFS: "Read-only file system",
                  errno.EACCES: "Permission denied", errno.EPERM: "Operation not permitted"}
# how libraries that do not raise OSError word the same causes (torch's zip writer, safetensors' Rust errors)
_CAUSE_WORDS = {"No space left on device": "No space left on device", "StorageFull": "No space left on device",
                "os error 28": "No space left on device", "Disk quota exceeded": "Disk quota exceeded",
                "File too large": "File too large", "Read-only file system": "Read-only file system"}


def size(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def free_bytes(path: Path) -> Optional[int]:
    """Bytes available to this user on the filesystem that holds `path` (its nearest existing ancestor)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def storage_cause(err: BaseException) -> tuple[Optional[str], Optional[int]]:
    """(the OS's words for a storage failure somewhere in `err`'s chain, its errno), or (None, None)."""
    seen, todo = set(), [err]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
            return STORAGE_ERRNOS[current.errno], current.errno
        text = str(current)
        for words, cause in _CAUSE_WORDS.items():
            if words in text:
                return cause, next(k for k, v in STORAGE_ERRNOS.items() if v == cause)
        todo += [current.__cause__, current.__context__]
    return None, None


@contextmanager
def writing(path: Path, what: str, needed: Optional[int] = None, hint: str = "") -> Iterator[None]:
    """Turns a storage failure while writing `path` into a `StorageError`. `needed`: bytes the write needs, if
    known (a failure with less than that free counts as a full disk even when the library lost the errno);
    `hint`: what to do besides freeing space (e.g. which checkpoint is intact)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as err:
        cause, code = storage_cause(err)
        free = free_bytes(path)
        if cause is None and needed is not None and free is not None and free < needed:
            cause, code = STORAGE_ERRNOS[errno.ENOSPC], errno.ENOSPC
        if cause is None:
            raise
        amounts = ""
        if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # how much: only where space is the cause
            amounts = "; ".join(a for a in (f"needs ~{size(needed)}" if needed is not None else "",
                                            f"{size(free)} free there" if free is not None and code != errno.EFBIG
                                            else "") if a)
        todo = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
                errno.EFBIG: "raise the file size limit (ulimit -f)"}.get(code, "make it writable")
        message = f"cannot write {what} {path}: {cause}{f' ({amounts})' if amounts else ''}; {todo}"
        message += f". {hint}" if hint else ""
        raise StorageError(message, path, code) from (err if debug() else None)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensor storages in a nested dict/list (what torch.save writes, give or take its metadata)."""
    import torch

    seen, total, todo = set(), 0, [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            todo += list(item.values())
        elif isinstance(item, (list, tuple)):
            todo += list(item)
    return total


def write_atomic(path: Union[str, Path], data: Union[str, bytes], what: str) -> None:
    """`path` holds `data` afterwards, or (on any failure) what it held before."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with writing(path, what, needed=len(payload)):
        try:
            with open(tmp, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def append_text(path: Union[str, Path], text: str, what: str) -> None:
    """Appends `text` to `path`; a failed append is cut off again, so the file keeps only whole earlier lines."""
    path = Path(path)
    payload = memoryview(text.encode())
    with writing(path, what, needed=len(payload)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                while payload:  # unbuffered: nothing is left in a buffer to fail again on close
                    payload = payload[os.write(fd, payload):]
            except BaseException:
                os.ftruncate(fd, start)  # frees blocks: never needs space
                raise
        finally:
            os.close(fd)


PROBE_BYTES = 64 * 1024  # about what Hydra and the first metrics write: a full disk fails here, not halfway


def check_writable_dir(path: Path, key: str) -> None:
    """`path` is (or can be made) a directory this process can write `PROBE_BYTES` into; else `StorageError` or
    ValueError, one line naming `key`."""
    blocker = next((p for p in (path, *path.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ValueError(f"{key}={str(path)!r}: {blocker} is a file, not a directory; pass {key}=ANOTHER_DIR")
    with writing(path, "the run directory", needed=PROBE_BYTES, hint=f"Or pass {key}=ANOTHER_DIR"):
        path.mkdir(parents=True, exist_ok=True)  # Hydra would create it next
        probe = path / f".write-probe-{socket.gethostname()}-{os.getpid()}"
        try:
            with open(probe, "wb") as handle:
                handle.write(b"\0" * PROBE_BYTES)
        finally:
            probe.unlink(missing_ok=True)
