"""One run per run directory: a run holds an exclusive `flock` on `<run dir>/.lit_rlvr.lock` from before it writes
there until its process ends, and a second run started in the same directory (the same `hydra.run.dir`, two runs
started in the same second of the default `${now:...}` one, the same CLI `default_root_dir`) is refused in one line
naming the directory, before any work. The kernel releases the lock when the process ends, however it ends (even
by SIGKILL), so a lock file left behind is never stale. Only the first process of a multi-process run (rank 0 of
torchrun, SLURM or Lightning's launcher) takes it: its ranks share the directory.

A directory that holds an earlier run (its metrics.csv, checkpoints/, summary.json or eval.json) is refused the same
way unless the new run continues that one (`resume=` for train.py, `fit --ckpt_path` for the CLI): Lightning's
CSVLogger would delete its metrics.csv and the new checkpoints would replace its own.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

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


def hold_run_dir(run_dir: Path, key: str, resume_key: str, resuming: bool = False) -> None:
    """Take `run_dir` for this process until it ends (a no-op where it holds it already, or on a rank other than
    the first); a `ConfigError` naming the directory, the process holding it and `key` (the setting that chooses the
    directory) when another process does, or naming what an earlier run left there when this run does not continue
    it (`resuming`; `resume_key` is the setting that would)."""
    run_dir = Path(run_dir).absolute()
    if run_dir in _held or launch_rank() != 0:
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
    left = [name for name in RUN_FILES if (run_dir / name).exists()]
    if left and not resuming:  # checked under the lock: no other run can start writing there meanwhile
        if fd >= 0:
            os.close(fd)
        raise ConfigError([f"{key}={str(run_dir)!r} holds an earlier run ({', '.join(left)}), which a new run there "
                           f"would overwrite: pass {key}=ANOTHER_DIR, or continue that run with "
                           f"{resume_key}={run_dir / 'checkpoints' / 'last.ckpt'}"])
    if fd >= 0:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[run_dir] = fd
