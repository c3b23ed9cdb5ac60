"""One run per run directory: a run holds an exclusive `flock` on `<run dir>/.lit_rlvr.lock` from before it writes
there until its process ends, and a second run started in the same directory (the same `hydra.run.dir`, two runs
started in the same second of the default `${now:...}` one, the same CLI `default_root_dir`) is refused in one line
naming the directory, before any work. The kernel releases the lock when the process ends, however it ends (even
by SIGKILL), so a lock file left behind is never stale. Only the first process of a multi-process run (rank 0 of
torchrun, SLURM or Lightning's launcher) takes it: its ranks share the directory.

A directory that holds an earlier run (its metrics.csv, checkpoints/, summary.json or eval.json) is refused the same
way unless the new run continues that one from a checkpoint inside it (train.py's `resume=`, which keeps the
earlier rows of metrics.csv): Lightning's CSVLogger would delete its metrics.csv and the new checkpoints would
replace its own. The Lightning CLI never continues a run in its own directory (its CSVLogger would drop the rows
before the checkpoint), so there a run's directory is always a new one.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Optional

from lit_rlvr.config.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = ".lit_rlvr.lock"
RUN_FILES = ("metrics.csv", "checkpoints", "summary.json", "eval.json")  # what a run leaves in its directory
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK")  # set by torchrun, SLURM, Lightning's launcher
_held: dict[Path, int] = {}  # run dir -> the open lock file's descriptor, for the process's lifetime


def launch_rank() -> int:
    """This process's rank in a multi-process launch, from the launchers' environment (0 when there is none)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def earlier_run(run_dir: Path) -> list[str]:
    """What an earlier run left in `run_dir` (names of RUN_FILES), none for a new directory."""
    return [name for name in RUN_FILES if (Path(run_dir) / name).exists()]


def hold_run_dir(run_dir: Path, key: str, resume_key: Optional[str], resume_from: Optional[str] = None) -> None:
    """Take `run_dir` for this process until it ends (a no-op where it holds it already, or on a rank other than
    the first); a `ConfigError` naming the directory, the process holding it and `key` (the setting that chooses the
    directory) when another process does, or naming what an earlier run left there unless this run continues that
    one: `resume_from` (the checkpoint given by the setting `resume_key`) lies in `run_dir`. `resume_key` None: a
    run that does not continue runs in their own directory (an evaluation, the Lightning CLI)."""
    run_dir = Path(run_dir).absolute()
    if launch_rank() != 0:
        return
    if run_dir in _held:  # this process holds it: for this run (checked already), or for a sweep's earlier job
        _refuse_an_earlier_run(run_dir, key, resume_key, resume_from)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError([f"{key}={str(run_dir)!r} is in use by another run (pid {holder}); two runs in one "
                           "directory would overwrite each other's checkpoints and metrics: pass "
                           f"{key}=ANOTHER_DIR, or wait for that run to end"]) from None
    except OSError as err:  # a file system without locks (some network mounts): run, unguarded, and say so
        os.close(fd)
        log.warning("%s=%s: cannot lock %s (%s); a second run started in this directory would not be refused",
                    key, run_dir, path, err)
        fd = -1
    try:  # under the lock: no other run can start writing there meanwhile
        _refuse_an_earlier_run(run_dir, key, resume_key, resume_from)
    except ConfigError:
        if fd >= 0:
            os.close(fd)
        raise
    if fd >= 0:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[run_dir] = fd


def _refuse_an_earlier_run(run_dir: Path, key: str, resume_key: Optional[str], resume_from: Optional[str]) -> None:
    left = earlier_run(run_dir)
    if not left or (resume_key and resume_from and run_dir.resolve() in Path(resume_from).resolve().parents):
        return
    last = run_dir / "checkpoints" / "last.ckpt"
    hint = "" if resume_key is None else (f", or continue that run with {resume_key}={last}" if last.exists() else
                                          " (that run saved no checkpoint to continue from)")
    raise ConfigError([f"{key}={str(run_dir)!r} holds an earlier run ({', '.join(left)}), which a new run there would "
                       f"overwrite: pass {key}=ANOTHER_DIR{hint}"])
