"""The local code sandbox: one fresh, isolated process per program run, never blocking past its limits.

Every run is one fresh process: a launcher (a separate `python -I -S` with the trainer's privileges, so
no fork of the multi-threaded trainer runs Python code) sets up isolation and execs the program with the
trainer's interpreter (or a system python3 when the sandbox uid cannot reach it, e.g. under /root/.pyenv).
What is enforced depends on the machine; `capabilities()` says what this one allows and
`CodeReward.enforced` what a reward's runs get:
  - always: wall-clock limit (the launcher SIGKILLs the program; the training process SIGKILLs the
    launcher's whole process group if even that overruns), RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE
    (output and file size cap; stdout/stderr go to files, so a flood cannot fill the parent's memory),
    RLIMIT_NOFILE, no core dumps, no inherited file descriptors (only 0, 1, 2), a minimal environment (the
    parent's variables, secrets included, are not passed), `python -I` (no PYTHON* variables, no user
    site), a fresh working directory removed afterwards;
  - as root: the program runs under a fresh random unprivileged uid/gid per run (no supplementary groups),
    so it cannot read or write root's files, cannot signal other processes, and RLIMIT_NPROC bounds a fork
    bomb to `max_procs` tasks for that run alone (a shared uid such as `nobody` would let concurrent runs
    eat each other's quota, and a kill-all-by-uid sweep would hit the neighbours);
  - with namespaces (root on Linux): a new network namespace (no interfaces up: no network, not even
    loopback), a new PID namespace (the program is pid 1 there; when it dies or is killed the kernel kills
    every descendant, so nothing leaks, and a fresh /proc hides the host's processes), a new mount
    namespace with private size-capped tmpfs over /tmp, /var/tmp, /dev/shm, /run/lock and the working
    directory (writes there vanish with the run and cannot fill the disk), a new IPC namespace (SysV
    segments, queues and semaphores die with the run; the host's are out of sight);
  - with seccomp (any user on Linux x86_64/aarch64): no AF_UNIX socket (a network namespace does not cover
    filesystem sockets), socketpair for stream pairs only, no io_uring.
Still shared with the host: read access to world-readable files (the filesystem is not hidden, only
private scratch dirs), a system-wide memory cap (no cgroups: worst case is `max_procs × memory_mb` of
address space), CPU share between concurrent runs, the kernel's other syscalls. Without root there is no
uid switch and no namespaces (SysV IPC is then shared); RLIMIT_NPROC then counts all the user's processes
(set to current + `max_procs`).
A sandbox failure (the launcher itself broke) is `ExecResult.status == "sandbox_error"`, never a wrong answer.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lit_rlvr.config.errors import SandboxError

log = logging.getLogger(__name__)

# Fresh uids come from a range far above real users and container subuid ranges (uid_t is 32-bit).
_UID_BASE = 2_000_000_000
_UID_SPAN = 1 << 26
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Limits:
    """Per-run limits. `timeout_s` is per run (= per test case); the CPU limit is the same, rounded up."""

    timeout_s: float = 4.0
    memory_mb: int = 512  # RLIMIT_AS of each process of the run
    max_output_bytes: int = 1 << 20  # cap on stdout, on stderr, and on any file the program writes
    max_procs: int = 16  # RLIMIT_NPROC: processes + threads of one run (fork bombs stop here)
    isolate_network: bool = True  # network namespace when the machine allows it
    scratch_mb: int = 64  # size of each private tmpfs (working dir, /tmp, ...) with a mount namespace
    site_packages: bool = True  # False runs `python -I -S`: faster start, stdlib only
    tmp_root: str | None = None  # where run directories are made (default: tempfile.gettempdir())
    python: str | None = None  # interpreter for programs (default: this one, if the sandbox uid can run it)

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_output_bytes", "max_procs", "scratch_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"code reward limits: {name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ExecResult:
    status: str  # ok | timeout | memory | runtime_error | output_limit | sandbox_error
    stdout: str
    stderr: str
    returncode: int | None  # negative = killed by that signal; None = no exit status (sandbox error)
    wall_s: float


# The two programs the sandbox runs, as files run by path (stdlib only; see their docstrings)
SANDBOX_LAUNCHER = Path(__file__).with_name("launcher.py")
SANDBOX_HARNESS = Path(__file__).with_name("harness.py")


@functools.lru_cache(maxsize=None)
def capabilities(python: str | None = None) -> dict:
    """What this machine enforces for code runs (probed once, in a child process; nothing changes here).

    Keys: `root`, `setuid` (a fresh unprivileged uid per run), `netns`, `pidns`, `mountns` (namespaces),
    `python` (the interpreter programs run with: this one, or a system python3 when the sandbox uid cannot
    reach this one), `python_ok`, `rlimits` (always set). Raises SandboxError when no usable interpreter.
    """
    explicit, python = python is not None, python or sys.executable
    caps = _probe(python)
    if not caps["python_ok"] and not explicit:
        # The trainer's interpreter may live where other uids cannot reach (e.g. under /root/.pyenv).
        for cand in ("/usr/local/bin/python3", "/usr/bin/python3"):
            cand_caps = _probe(cand) if os.path.exists(cand) else {"python_ok": False}
            if cand_caps["python_ok"]:
                python, caps = cand, cand_caps
                break
    if not caps["python_ok"]:
        # Never fall back to running programs as root: say which setting to change instead.
        raise SandboxError(f"code sandbox: {python} cannot be run by an unprivileged uid; set Limits.python "
                           "to an interpreter that every user can execute (e.g. /usr/bin/python3)")
    caps["python"] = python
    caps["rlimits"] = ["AS", "CPU", "FSIZE", "NOFILE", "CORE", "NPROC"]
    return caps


def _probe(python: str) -> dict:
    """Runs the launcher's probe in a fresh interpreter; all False if even that fails."""
    probe_dir = tempfile.mkdtemp(prefix="lit_rlvr_probe_")
    cfg = {"python": python, "uid": _UID_BASE + secrets.randbelow(_UID_SPAN), "workdir": probe_dir}
    try:
        out = subprocess.run(
            [sys.executable, "-I", "-S", str(SANDBOX_LAUNCHER), "probe", json.dumps(cfg)],
            capture_output=True, text=True, timeout=30, env={"PATH": _SAFE_PATH}, start_new_session=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as err:
        log.warning("code sandbox probe failed (%s): only rlimits will be enforced", err)
        return {"root": os.geteuid() == 0, "netns": False, "pidns": False, "mountns": False, "setuid": False,
                "ipcns": False, "seccomp": False, "python_ok": True}
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------
# Running one program


def run_program(
    source: str, stdin: str = "", *, limits: Limits | None = None, fn_name: str | None = None
) -> ExecResult:
    """Runs `source` once in a fresh sandboxed process, feeding `stdin`; never blocks past the limits.

    With `fn_name`, `stdin` is the JSON argument list and stdout the JSON return value (call-based tests).
    """
    limits = limits or Limits()
    caps = capabilities(limits.python)
    run_dir = tempfile.mkdtemp(prefix="lit_rlvr_code_", dir=limits.tmp_root)
    try:
        return _run_in(run_dir, source, stdin, limits, caps, fn_name)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # as root this also removes the sandbox uid's files


def _run_in(run_dir: str, source: str, stdin: str, limits: Limits, caps: dict, fn_name: str | None) -> ExecResult:
    """Lays out the run directory, starts the launcher, waits with a hard backstop, reads the result."""
    os.chmod(run_dir, 0o711)  # the sandbox uid may traverse (fallback without mount ns), not list
    src_dir, workdir = os.path.join(run_dir, "src"), os.path.join(run_dir, "work")
    os.mkdir(src_dir, 0o700)
    os.mkdir(workdir, 0o700)
    _write(os.path.join(src_dir, "solution.py"), source)
    entry = ["solution.py"]
    if fn_name is not None:
        _write(os.path.join(src_dir, "_harness.py"), SANDBOX_HARNESS.read_text())
        entry = ["_harness.py", fn_name]
    _write(os.path.join(run_dir, "stdin"), stdin)
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if caps["setuid"] else None
    if uid is not None and not caps["mountns"]:
        _check_traversable(workdir)
    flags = ["-I", "-B", "-X", "utf8"] + ([] if limits.site_packages else ["-S"])
    cfg = {
        "python": caps["python"], "argv": flags + entry, "src_dir": src_dir, "workdir": workdir,
        "status": os.path.join(run_dir, "status.json"), "uid": uid, "timeout_s": limits.timeout_s,
        "cpu_s": math.ceil(limits.timeout_s), "memory_bytes": limits.memory_mb << 20,
        "fsize": limits.max_output_bytes + 1,  # one byte over the cap tells "limit hit" from "exactly at it"
        "max_procs": limits.max_procs, "scratch_bytes": limits.scratch_mb << 20,
        "netns": limits.isolate_network and caps["netns"], "pidns": caps["pidns"], "mountns": caps["mountns"],
        "ipcns": caps["ipcns"], "seccomp": caps["seccomp"],
        "env": {"PATH": _SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},  # threads count in NPROC
    }
    out_path, err_path = os.path.join(run_dir, "stdout"), os.path.join(run_dir, "stderr")
    t0 = time.monotonic()
    with open(os.path.join(run_dir, "stdin"), "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SANDBOX_LAUNCHER), "run", json.dumps(cfg)],
            stdin=fin, stdout=fout, stderr=ferr, env={"PATH": _SAFE_PATH}, cwd=run_dir,
            close_fds=True, start_new_session=True,
        )
    _wait_or_kill(proc, limits.timeout_s + 10.0, uid)
    wall = time.monotonic() - t0
    return _result(run_dir, out_path, err_path, limits, wall)


def _check_traversable(path: str) -> None:
    """Without a mount namespace the sandbox uid reaches its working dir by path: every parent needs o+x."""
    parent = os.path.dirname(path)
    while parent != os.path.dirname(parent):
        if not os.stat(parent).st_mode & 0o001:
            raise SandboxError(f"code sandbox: {parent} is not traversable by other users; set tmp_root to a "
                               "directory whose parents all have o+x (e.g. /tmp)")
        parent = os.path.dirname(parent)


def _wait_or_kill(proc: subprocess.Popen, backstop_s: float, uid: int | None) -> None:
    """The launcher kills on time; if even it overruns, kill its whole group (its child dies with it)."""
    try:
        proc.wait(timeout=backstop_s)
        return
    except subprocess.TimeoutExpired:
        log.warning("code sandbox launcher overran its deadline; killing its process group")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        log.error("code sandbox launcher %d did not die after SIGKILL", proc.pid)
    if uid is not None:
        _sweep_uid(uid)


def _sweep_uid(uid: int) -> None:
    """Kills every process of a run's fresh uid, from a separate interpreter (never fork the trainer)."""
    code = f"import os, signal; os.setgid({uid}); os.setuid({uid}); os.kill(-1, signal.SIGKILL)"
    subprocess.run([sys.executable, "-I", "-S", "-c", code], env={"PATH": _SAFE_PATH}, timeout=10, check=False)


def _result(run_dir: str, out_path: str, err_path: str, limits: Limits, wall: float) -> ExecResult:
    """Classifies the run from the launcher's status file and the capped outputs."""
    cap = limits.max_output_bytes
    stdout, out_over = _read_capped(out_path, cap)
    stderr, err_over = _read_capped(err_path, cap)
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            st = json.load(f)
    except (OSError, ValueError):
        st = {"error": "launcher died without a status", "exit": None}
    if st.get("error"):
        return ExecResult("sandbox_error", stdout, f"sandbox: {st['error']}\n{stderr}", None, wall)
    code, wall = st["exit"], st["wall_s"]
    if out_over or err_over:
        status = "output_limit"
    elif st["timed_out"] or code == -signal.SIGXCPU:
        status = "timeout"
    elif code != 0 and ("MemoryError" in stderr[-4096:] or code == -signal.SIGKILL):
        status = "memory"  # RLIMIT_AS → MemoryError; an unexplained SIGKILL is most likely the OOM killer
    elif code != 0:
        status = "runtime_error"
    else:
        status = "ok"
    return ExecResult(status, stdout, stderr, code, wall)


def _read_capped(path: str, cap: int) -> tuple[str, bool]:
    """At most `cap` bytes of a file, decoded; and whether the file was longer."""
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
