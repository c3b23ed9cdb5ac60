"""Whether a process still runs (for the vLLM worker's owner watch and the warm-up cache's stale temp folders), and
a process's peak memory (for run summaries and the benchmarks)."""

from __future__ import annotations

import os
import resource


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone, or no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not os.path.isdir("/proc")  # /proc exists but had no entry: gone


def peak_rss_mb(pid: int | str = "self") -> float:
    """The peak resident memory (MB) of process `pid` since it started its program: `VmHWM` in /proc.

    Not `ru_maxrss`: Linux carries the high-water mark across `exec`, so a process started by vfork (or fork) and
    exec reads its parent's peak (or resident) memory of that moment (a small engine process started by a 1 GB
    trainer reads 1 GB). Without /proc (other systems), this process's `ru_maxrss`."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    if pid not in ("self", os.getpid()):
        raise ProcessLookupError(f"no peak memory for process {pid}: it has ended, or this system has no /proc")
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
