"""Cache entries (a folder per key, e.g. a warmed-up tiny model) that are complete or absent.

An entry is written into a temp folder beside it; each file is fsynced, then `MANIFEST.json` (every file's size
and sha256) is written last, and the folder is renamed to its key. `verify` checks the manifest on every use, so
a truncated or altered file is found before anything loads it; a corrupt entry is named and moved out of the
way (`discard`), or, where the cache cannot be written, refused with the command that clears it. An entry of an
older version without a manifest is accepted when its files are whole (JSON parses, safetensors complete) and
gets its manifest then.

The cache directory comes from `LIT_RLVR_CACHE` (default ~/.cache/lit_rlvr) or `model.options.cache_dir`; an
empty value, a path that is not a directory, or one that cannot be written is one line naming the setting.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import struct
from pathlib import Path
from typing import Callable, Optional, Union

from lit_rlvr.config.errors import StorageError
from lit_rlvr.run.processes import pid_alive
from lit_rlvr.run.storage import STORAGE_ERRNOS, write_atomic, writing

log = logging.getLogger(__name__)

ENV = "LIT_RLVR_CACHE"
DEFAULT = "~/.cache/lit_rlvr"
MANIFEST = "MANIFEST.json"


def default_cache_dir() -> str:
    """`$LIT_RLVR_CACHE` as set (even empty: `cache_root` refuses that), else ~/.cache/lit_rlvr."""
    return os.environ.get(ENV, DEFAULT)


def setting(cache_dir: Union[str, Path]) -> str:
    """Which setting chose `cache_dir`, for error messages: the variable when its value is this one."""
    env = os.environ.get(ENV)
    return ENV if env is not None and str(cache_dir) == env else "model.options.cache_dir"


def cache_root(cache_dir: Union[str, Path]) -> Path:
    """The cache directory as a Path; ValueError (one line, naming the setting) when it cannot be one."""
    if not str(cache_dir).strip():
        raise ValueError(f"{setting(cache_dir)}={str(cache_dir)!r} is set but empty, which would put the tiny "
                         f"model's warm-up cache in the current directory: set {ENV} to a directory, or unset it "
                         f"(default {DEFAULT})")
    root = Path(cache_dir).expanduser()
    blocker = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ValueError(f"{setting(cache_dir)}={str(cache_dir)!r}: {blocker} is a file, not a directory; set "
                         f"{setting(cache_dir)} to a directory (unset {ENV}: {DEFAULT})")
    return root


def verify(entry: Path) -> Optional[str]:
    """None when `entry` is complete, else what is wrong with it (one short phrase)."""
    manifest = entry / MANIFEST
    if not manifest.is_file():
        return _legacy_problem(entry)
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} unreadable ({type(err).__name__})"
    for name, expected in files.items():
        path = entry / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {expected['bytes']} were written"
        if _sha256(path) != expected["sha256"]:
            return f"{name} differs from what was written (sha256)"
    return None


def _legacy_problem(entry: Path) -> Optional[str]:
    """An entry written before manifests: whole if its JSON files parse and its safetensors files are complete."""
    if not (entry / "config.json").is_file():
        return "config.json missing"
    weights = sorted(entry.glob("*.safetensors"))
    if not weights:
        return "no weights file"
    for path in sorted(entry.glob("*.json")):
        try:
            json.loads(path.read_text())
        except (OSError, ValueError) as err:
            return f"{path.name} unreadable ({type(err).__name__})"
    for path in weights:
        problem = _safetensors_problem(path)
        if problem:
            return problem
    try:  # whole: record it, so the next use checks checksums (a read-only cache is used as it is)
        _write_manifest(entry)
    except OSError:
        pass
    return None


def _safetensors_problem(path: Path) -> Optional[str]:
    """A safetensors file is an 8-byte header length, a JSON header, and the tensors' bytes up to the header's
    largest end offset: a shorter (or longer) file is not whole."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as err:
        return f"{path.name} unreadable ({type(err).__name__})"
    if path.stat().st_size != 8 + length + end:
        return f"{path.name} has {path.stat().st_size} bytes, its header says {8 + length + end}"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST):
        with path.open("rb") as handle:
            os.fsync(handle.fileno())  # the data is on disk before the manifest vouches for it
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    write_atomic(folder / MANIFEST, json.dumps({"files": files}, indent=1), "the cache entry's manifest")


def write_entry(entry: Path, fill: Callable[[Path], None], needed: int, cache_dir: Union[str, Path]) -> None:
    """Builds `entry` whole or not at all: `fill(folder)` writes the files into a temp folder beside it, the
    manifest follows, then one rename. A failure (a full disk) removes the temp folder and is one line."""
    tmp = entry.with_name(f"{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}")  # unique on a shared filesystem
    with writing(entry, "the warm-up cache entry", needed=needed, hint=_hint(cache_dir)):
        try:
            tmp.mkdir(parents=True)
            fill(tmp)
            _write_manifest(tmp)
            try:
                tmp.rename(entry)  # atomic: a half-written entry is never used
            except OSError:  # another process finished the same entry first (same key, same content)
                if verify(entry) is not None:
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def prepare(root: Path, cache_dir: Union[str, Path], entry: Path, problem: Optional[str]) -> None:
    """Creates the cache directory, or fails in one line naming the setting (read-only, permission denied); for
    a corrupt `entry` (`problem`) in a cache that cannot be written, the line gives the command that clears it."""
    try:
        with writing(root, "the warm-up cache directory", hint=_hint(cache_dir)):
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".probe-{socket.gethostname()}-{os.getpid()}"
            probe.touch()
            probe.unlink()
    except StorageError as err:
        if problem is None:
            raise
        raise _refused(entry, problem, STORAGE_ERRNOS.get(err.errno, str(err)), err.errno) from None


def discard(entry: Path, problem: str) -> None:
    """Moves a corrupt entry out of the way (one rename, then removal); refuses, with the command that clears
    it, when the cache cannot be changed."""
    aside = entry.with_name(f"{entry.name}.corrupt-{os.getpid()}")
    try:
        entry.rename(aside)
    except OSError as err:
        raise _refused(entry, problem, err.strerror, err.errno) from None
    log.warning("the warm-up cache entry %s is corrupt (%s): rebuilding it", entry, problem)
    shutil.rmtree(aside, ignore_errors=True)


def _refused(entry: Path, problem: str, why: str, code: Optional[int]) -> StorageError:
    return StorageError(f"the warm-up cache entry {entry} is corrupt ({problem}) and cannot be removed ({why}); "
                        f"clear it with: rm -rf '{entry}'", entry, code)


def sweep(entry: Path) -> None:
    """Removes temp folders of `entry` left on this host by a process that was killed while writing it."""
    host = socket.gethostname()
    for stale in entry.parent.glob(f"{entry.name}.tmp-{host}-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    for stale in entry.parent.glob(f"{entry.name}.corrupt-*"):
        shutil.rmtree(stale, ignore_errors=True)




def _hint(cache_dir: Union[str, Path]) -> str:
    return f"Or point {setting(cache_dir)} at a writable directory"
