"""Real full disks and read-only directories for tests, without root: the command runs in its own user and
mount namespace (`unshare -Urm`), where a small tmpfs or a read-only bind mount affects only that command.
The kernel then answers ENOSPC or EROFS exactly as a full or read-only disk would. Where the machine allows no
user namespaces, `namespaces_work()` is False and the tests that need one skip."""

from __future__ import annotations

import functools
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence


@functools.lru_cache(maxsize=1)
def namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && "
                            "mount --bind /mnt /mnt && mount -o remount,ro,bind /mnt /mnt"], capture_output=True)
    return probe.returncode == 0


def run(command: Sequence[str], *, tmpfs: Optional[tuple[Path, int]] = None, read_only: Sequence[Path] = (),
        fill: Optional[tuple[Path, int]] = None, then: Optional[Sequence[str]] = None, cwd: Optional[Path] = None,
        env: Optional[dict] = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`command` with `tmpfs=(dir, kB)` mounted (a disk of that size), each `read_only` dir remounted read-only,
    and `fill=(dir, kB)`: a file of that size written into dir first (so a disk is nearly full from the start).
    `then`: a second command in the same namespace afterwards (to look at what the first left on the tmpfs,
    which is gone with the namespace); its output follows, the exit code is the first command's."""
    steps = []
    if tmpfs is not None:
        steps.append(f"mkdir -p {shlex.quote(str(tmpfs[0]))} && mount -t tmpfs -o size={tmpfs[1]}k tmpfs "
                     f"{shlex.quote(str(tmpfs[0]))}")
    for path in read_only:
        quoted = shlex.quote(str(path))
        steps.append(f"mount --bind {quoted} {quoted} && mount -o remount,ro,bind {quoted} {quoted}")
    if fill is not None:
        steps.append(f"(dd if=/dev/zero of={shlex.quote(str(fill[0] / 'filler'))} bs=1k count={fill[1]} "
                     "2>/dev/null || true)")
    quote = lambda words: " ".join(shlex.quote(str(w)) for w in words)  # noqa: E731
    script = " && ".join(steps) + " && { " + quote(command) + "; rc=$?; "
    script += (quote(then) + "; " if then else "") + "exit $rc; }"
    return subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
