"""Whether a process still runs: for the vLLM worker's owner watch and the warm-up cache's stale temp folders."""

from __future__ import annotations

import os


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
