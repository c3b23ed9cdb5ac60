"""Code reward: run the completion's program against the row's tests in a sandbox; +1 all pass, −1 otherwise.

Rules (DESIGN §8, §10):

* The program is the last fenced code block whose info string names the language (```python, ```py, ...);
  without one, the last untagged block. No closed block = malformed (a truncated block is not a program).
* The row's `answer` is the test specification: a dict or JSON string `{"inputs": [...], "outputs": [...],
  "fn_name": optional}` (APPS / TACO / CodeR1 / LiveCodeBench style; APPS' `{"input_output": "..."}` too), or
  a list of `{"input": ..., "output": ...}` cases. Without `fn_name` every case is stdin → stdout, compared
  line by line after whitespace normalisation (numeric tokens within 1e-6). With `fn_name` the program
  defines that function (or a method of `class Solution`); a case's input is the argument list (a list, a
  dict of keyword arguments, or LiveCodeBench's one-JSON-value-per-line string) and its output the return
  value, compared after JSON normalisation (tuples → lists) with float tolerance 1e-6. Tests run in order and
  stop at the first failure.
* Every run is one fresh process: a launcher (a separate `python -I -S` with the trainer's privileges, so
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
* A sandbox failure (the launcher itself broke) is not a wrong answer: `CodeReward.__call__` raises
  `SandboxError` so `RewardRunner` counts it; `score_batch` scores it malformed and counts `failures`.

Only Python programs are executed for now (`language="python"`); `extract_program` knows other languages.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from lit_rlvr.rewards.base import RewardResult

log = logging.getLogger(__name__)

__all__ = [
    "CodeReward",
    "ExecResult",
    "Limits",
    "SandboxError",
    "capabilities",
    "check_tests",
    "extract_program",
    "parse_tests",
    "run_program",
]

# Fresh uids come from a range far above real users and container subuid ranges (uid_t is 32-bit).
_UID_BASE = 2_000_000_000
_UID_SPAN = 1 << 26
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_LANG_ALIASES = {
    "python": {"python", "py", "python3", "py3"},
    "cpp": {"cpp", "c++", "cc", "cxx"},
    "c": {"c"},
    "java": {"java"},
    "javascript": {"javascript", "js", "node"},
    "rust": {"rust", "rs"},
    "go": {"go", "golang"},
}
# A fence may be indented (inside a list); the info string's first word is the language.
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): an infrastructure error, never a wrong answer."""


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


# --------------------------------------------------------------------------------------------------------
# Program extraction


def extract_program(completion: str, language: str = "python") -> str | None:
    """The last closed fenced block tagged with `language` (or an alias); else the last untagged block.

    Blocks tagged with another language (```text, ```bash) are never taken; None when nothing fits.
    """
    names = _LANG_ALIASES.get(language.lower(), {language.lower()})
    tagged, untagged = None, None
    for match in _FENCE_RE.finditer(completion):
        tag, body = match.group(1).lower(), match.group(2)
        if not body.strip():
            continue
        if tag in names:
            tagged = body
        elif not tag:
            untagged = body
    return tagged if tagged is not None else untagged


# --------------------------------------------------------------------------------------------------------
# The sandbox launcher: a stdlib-only script run as `python -I -S -c _SANDBOX_SRC MODE CONFIG` as the
# training process's user. It is a fresh single-threaded interpreter, so forking, unsharing and dropping
# privileges are safe there (a `preexec_fn` in the multi-threaded trainer could deadlock).

_SANDBOX_SRC = r'''
import ctypes, json, os, resource, signal, sys, time

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC = 0x00020000, 0x20000000, 0x40000000, 0x08000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
# audit arch -> syscall numbers (socket, socketpair, io_uring_setup); little-endian 64-bit only
SYSCALLS = {"x86_64": (0xC000003E, 41, 53, 425), "aarch64": (0xC00000B7, 198, 199, 425)}
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # the world-writable places
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def private_mounts(workdir, scratch):
    """Private tmpfs over the world-writable dirs and the working dir; nothing propagates to the host."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    opts = f"size={scratch},nr_inodes=4096,mode=1777"
    for d in PRIVATE_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    os.makedirs(workdir, exist_ok=True)  # the host's copy may now be hidden under the private /tmp
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch},nr_inodes=4096,mode=0700")


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def unix_socket_filter():
    """A seccomp program: socket(AF_UNIX) and io_uring fail with EACCES, socketpair only for SOCK_STREAM (a
    connected pair cannot reach a path; asyncio needs it), other ABIs (i386, x32) kill the process.

    A network namespace does not cover filesystem sockets (connect by path) and a 0777 socket is open to any
    uid; this closes every way to one. Returns None on an unknown machine."""
    arch = SYSCALLS.get(os.uname().machine)
    if arch is None:
        return None
    audit, nr_socket, nr_socketpair, nr_io_uring = arch
    LD, JEQ, JGE, AND, RET = 0x20, 0x15, 0x35, 0x54, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, ALU|AND|K, RET|K
    ALLOW, DENY, KILL = 0x7FFF0000, 0x00050000 | 13, 0x80000000  # SECCOMP_RET_ALLOW, _ERRNO|EACCES, _KILL_PROCESS
    prog = [  # (code, jump if true, jump if false, k); jumps name a label, or 0 for the next instruction
        (LD, 0, 0, 4), (JEQ, "nr", 0, audit), (RET, 0, 0, KILL),
        ("nr", LD, 0, 0, 0), (JGE, "deny", 0, 0x40000000), (JEQ, "deny", 0, nr_io_uring),
        (JEQ, 0, "pair", nr_socket), (LD, 0, 0, 16), (JEQ, "deny", "allow", 1),  # args[0] == AF_UNIX
        ("pair", JEQ, 0, "allow", nr_socketpair), (LD, 0, 0, 24), (AND, 0, 0, 0xF),
        (JEQ, "allow", "deny", 1),  # (type & 0xf) == SOCK_STREAM
        ("allow", RET, 0, 0, ALLOW), ("deny", RET, 0, 0, DENY),
    ]
    labels = {ins[0]: i for i, ins in enumerate(prog) if isinstance(ins[0], str)}
    prog = [ins[1:] if isinstance(ins[0], str) else ins for ins in prog]
    rel = lambda i, j: 0 if j == 0 else labels[j] - i - 1
    return (SockFilter * len(prog))(*(SockFilter(c, rel(i, t), rel(i, f), k) for i, (c, t, f, k) in enumerate(prog)))


def block_unix_sockets():
    """Installs `unix_socket_filter` on this process and what it execs (no_new_privs is required for it)."""
    prog = unix_socket_filter()
    if prog is None:
        raise OSError(0, f"no seccomp filter for {os.uname().machine}")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    fprog = SockFprog(len(prog), prog)
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(seccomp)")


def count_own_procs():
    """Processes of this uid (RLIMIT_NPROC counts per user; used only when the uid is not fresh)."""
    uid, n = os.getuid(), 0
    for p in os.listdir("/proc"):
        try:
            n += p.isdigit() and os.stat(f"/proc/{p}").st_uid == uid
        except OSError:
            pass
    return n


def child(cfg, launcher_pid, err_w):
    """Becomes the program: limits, uid drop, exec. Runs as pid 1 of a new PID namespace when asked.

    A setup failure is reported on `err_w` (close-on-exec: a successful exec just closes it), so a program
    cannot pass itself off as a sandbox failure by what it prints or its exit code.
    """
    try:
        if cfg["pidns"]:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # hide the host's processes
        os.setsid()
        cpu = int(cfg["cpu_s"])
        nproc = cfg["max_procs"] if cfg["uid"] is not None else count_own_procs() + cfg["max_procs"]
        for res, val in ((resource.RLIMIT_AS, cfg["memory_bytes"]), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_FSIZE, cfg["fsize"]), (resource.RLIMIT_NOFILE, 64),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
            resource.setrlimit(res, val if isinstance(val, tuple) else (val, val))
        os.chdir(cfg["workdir"])
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        # After the uid change (which clears it): die with the launcher, so a killed launcher leaks nothing.
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        if cfg["seccomp"]:
            block_unix_sockets()
        if not cfg["pidns"] and os.getppid() != launcher_pid:
            raise RuntimeError("the launcher died before the program started")
        os.execve(cfg["python"], [cfg["python"], *cfg["argv"]], cfg["env"])
    except BaseException as err:
        os.write(err_w, f"cannot start the program: {err!r}".encode())
    os._exit(126)


def sweep(uid):
    """Kill every process of the fresh uid (descendants that left the process group); no-op with pidns."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)  # as that uid: all of its processes, nobody else's
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def run(cfg):
    """Sets up isolation, runs the program with a wall-clock kill, writes the status file."""
    status = {"error": None, "timed_out": False, "exit": None, "wall_s": 0.0, "cpu_s": 0.0}
    files = {}
    for name in os.listdir(cfg["src_dir"]):
        with open(os.path.join(cfg["src_dir"], name), "rb") as f:
            files[name] = f.read()
    out = open(cfg["status"], "w")
    try:
        flags = (CLONE_NEWNET if cfg["netns"] else 0) | (CLONE_NEWPID if cfg["pidns"] else 0)
        flags |= (CLONE_NEWNS if cfg["mountns"] else 0) | (CLONE_NEWIPC if cfg["ipcns"] else 0)
        if flags:
            check(libc.unshare(flags), "unshare")
        if cfg["mountns"]:
            private_mounts(cfg["workdir"], cfg["scratch_bytes"])
        for name, data in files.items():
            path = os.path.join(cfg["workdir"], name)
            with open(path, "wb") as f:
                f.write(data)
        if cfg["uid"] is not None:
            for path in [cfg["workdir"], *(os.path.join(cfg["workdir"], n) for n in files)]:
                os.chown(path, cfg["uid"], cfg["uid"])
    except OSError as err:
        status["error"] = f"sandbox setup failed: {err}"
        json.dump(status, out)
        return
    launcher_pid, t0 = os.getpid(), time.monotonic()
    err_r, err_w = os.pipe()  # close-on-exec by default
    pid = os.fork()
    if pid == 0:
        os.close(err_r)
        child(cfg, launcher_pid, err_w)
    os.close(err_w)

    def on_alarm(signum, frame):
        status["timed_out"] = True
        try:
            os.kill(pid, signal.SIGKILL)  # pid 1 of the namespace: the kernel kills the rest
            if not cfg["pidns"]:
                os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, cfg["timeout_s"])
    setup_error = os.read(err_r, 4096).decode(errors="replace")  # returns at exec (EOF) or on failure
    _, st, ru = os.wait4(pid, 0)  # retried after the handler (PEP 475), returns once the child is gone
    signal.setitimer(signal.ITIMER_REAL, 0)
    status["wall_s"] = time.monotonic() - t0
    if not cfg["pidns"]:
        try:
            os.killpg(pid, signal.SIGKILL)  # leftovers still in the program's process group
        except (ProcessLookupError, PermissionError):
            pass
        if cfg["uid"] is not None:
            sweep(cfg["uid"])
    status["exit"] = os.waitstatus_to_exitcode(st)
    status["cpu_s"] = ru.ru_utime + ru.ru_stime
    status["error"] = setup_error or None
    json.dump(status, out)


def try_in_child(fn):
    """True when fn() succeeds in a forked child (so nothing of the probe sticks to this process)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if fn() else 1)
        except BaseException:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def probe(cfg):
    """What this machine enforces: printed as one JSON object."""
    def pidns():
        check(libc.unshare(CLONE_NEWPID), "unshare")
        pid = os.fork()
        if pid == 0:
            os._exit(0 if os.getpid() == 1 else 1)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

    def mountns():
        check(libc.unshare(CLONE_NEWNS), "unshare")
        private_mounts(cfg["workdir"], 1 << 20)
        return True

    def as_uid(uid, run_python):
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if run_python:
            os.execv(cfg["python"], [cfg["python"], "-I", "-S", "-c", "pass"])
        return os.getuid() == uid

    root = os.geteuid() == 0
    setuid = root and try_in_child(lambda: as_uid(cfg["uid"], False))
    def seccomp():
        import socket
        block_unix_sockets()
        try:
            socket.socket(socket.AF_UNIX)
        except PermissionError:
            socket.socketpair()  # asyncio's self-pipe still works
            return True
        return False

    caps = {"root": root, "netns": try_in_child(lambda: libc.unshare(CLONE_NEWNET) == 0),
            "pidns": try_in_child(pidns), "mountns": try_in_child(mountns), "setuid": setuid,
            "ipcns": try_in_child(lambda: libc.unshare(CLONE_NEWIPC) == 0), "seccomp": try_in_child(seccomp),
            "python_ok": try_in_child(lambda: as_uid(cfg["uid"], True)) if setuid else True}
    print(json.dumps(caps))


if __name__ == "__main__":
    {"run": run, "probe": probe}[sys.argv[1]](json.loads(sys.argv[2]))
'''

# Call-based harness: runs the solution module, calls `fn_name` on the JSON arguments from stdin and
# writes the JSON result to the original stdout; the program's own prints go to /dev/null.
_HARNESS_SRC = r'''
import io, json, os, sys


def plain(x):
    """JSON-able form: tuples and sets become lists (sets sorted when possible)."""
    if hasattr(x, "tolist"):
        return x.tolist()  # numpy arrays and scalars
    if isinstance(x, (set, frozenset)):
        try:
            return sorted(x)
        except TypeError:
            return list(x)
    if hasattr(x, "__iter__") and not isinstance(x, (str, bytes, list, tuple, dict)):
        return list(x)  # generators, map objects, ranges
    return repr(x)


def main():
    fn_name, args = sys.argv[1], json.loads(sys.stdin.read())
    sys.stdin = io.StringIO("")  # a program that reads stdin at import time gets EOF, not our arguments
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # prints (even os.write(1, ...)) cannot corrupt the result
    ns = {"__name__": "solution", "__file__": "solution.py"}
    with open("solution.py") as f:
        exec(compile(f.read(), "solution.py", "exec"), ns)
    fn = ns.get(fn_name)
    if fn is None and isinstance(ns.get("Solution"), type):
        fn = getattr(ns["Solution"](), fn_name, None)  # LeetCode style
    if not callable(fn):
        sys.exit(f"harness: function {fn_name!r} is not defined by the program")
    result = fn(**args) if isinstance(args, dict) else fn(*args)
    result_out.write(json.dumps(result, default=plain))
    result_out.flush()


main()
'''


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
            [sys.executable, "-I", "-S", "-c", _SANDBOX_SRC, "probe", json.dumps(cfg)],
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
        _write(os.path.join(src_dir, "_harness.py"), _HARNESS_SRC)
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
            [sys.executable, "-I", "-S", "-c", _SANDBOX_SRC, "run", json.dumps(cfg)],
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


# --------------------------------------------------------------------------------------------------------
# Test specifications and comparison


def parse_tests(spec: Any) -> tuple[list[tuple[Any, Any]], str | None]:
    """(cases as (input, expected output) pairs, fn_name or None) from any supported spec form."""
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as err:
            raise ValueError(f"code test spec: not valid JSON ({err})") from None
    if isinstance(spec, dict) and "input_output" in spec:  # a raw APPS row
        return parse_tests(spec["input_output"])
    if isinstance(spec, list):
        try:
            cases = [(c["input"], c["output"]) for c in spec]
        except (TypeError, KeyError):
            raise ValueError("code test spec: a list must hold {'input': ..., 'output': ...} cases") from None
        fn_name = None
    elif isinstance(spec, dict) and "inputs" in spec and "outputs" in spec:
        if len(spec["inputs"]) != len(spec["outputs"]):
            raise ValueError(f"code test spec: {len(spec['inputs'])} inputs but {len(spec['outputs'])} outputs")
        cases, fn_name = list(zip(spec["inputs"], spec["outputs"])), spec.get("fn_name") or None
    else:
        raise ValueError("code test spec: expected {'inputs', 'outputs'[, 'fn_name']} or a list of cases, "
                         f"got {type(spec).__name__}")
    if not cases:
        raise ValueError("code test spec: no test cases")
    return cases, fn_name


def _call_args(case_input: Any) -> Any:
    """Argument list (or kwargs dict) of a call-based case; a string holds one JSON value per line."""
    if isinstance(case_input, str):
        return [_maybe_json(line) for line in case_input.splitlines() if line.strip()]
    if isinstance(case_input, (list, dict)):
        return case_input
    return [case_input]


def _maybe_json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _values_equal(got: Any, want: Any) -> bool:
    """Equality after JSON normalisation, numbers within 1e-6 (absolute or relative)."""
    if isinstance(got, bool) or isinstance(want, bool):
        return got is want
    if isinstance(got, int) and isinstance(want, int):
        return got == want  # exact for big ints (a float conversion would round them)
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6) or (got != got and want != want)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_values_equal(g, w) for g, w in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_values_equal(got[k], want[k]) for k in got)
    return got == want


def _call_output_matches(got: Any, want: Any) -> bool:
    """APPS wraps call-based outputs in a one-element list; LiveCodeBench writes them as JSON text."""
    want = json.loads(json.dumps(want))  # tuples → lists, keys → strings, like the program's result
    if _values_equal(got, want) or (isinstance(want, str) and _values_equal(got, _maybe_json(want))):
        return True
    return isinstance(want, list) and len(want) == 1 and _values_equal(got, want[0])


def _norm_lines(text: Any) -> list[list[str]]:
    if isinstance(text, list):
        text = "\n".join(map(str, text))
    return [line.split() for line in str(text).strip().splitlines() if line.strip()]


def _stdout_matches(got: str, want: Any) -> bool:
    """Line by line, whitespace-normalised; tokens that both parse as numbers may differ by 1e-6."""
    g, w = _norm_lines(got), _norm_lines(want)
    if g == w:
        return True
    if len(g) != len(w) or any(len(a) != len(b) for a, b in zip(g, w)):
        return False
    return all(_token_equal(a, b) for la, lb in zip(g, w) for a, b in zip(la, lb))


def _token_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def check_tests(source: str, spec: Any, limits: Limits | None = None) -> tuple[bool, dict]:
    """Runs the program on each case in order, stopping at the first failure.

    Returns (all passed, details) with details `total`, `passed`, and on failure `failed_case`, `status`
    (the run's status, or "wrong_answer") and `reason`. Raises SandboxError if the sandbox itself breaks.
    """
    cases, fn_name = parse_tests(spec)
    for i, (case_in, want) in enumerate(cases):
        if fn_name is None:
            stdin = "\n".join(map(str, case_in)) if isinstance(case_in, list) else str(case_in)
            res = run_program(source, stdin, limits=limits)
        else:
            res = run_program(source, json.dumps(_call_args(case_in)), limits=limits, fn_name=fn_name)
        if res.status == "sandbox_error":
            raise SandboxError(res.stderr.strip()[-500:])
        fail = _failure(res, want, fn_name)
        if fail is not None:
            return False, {"total": len(cases), "passed": i, "failed_case": i, "status": fail[0], "reason": fail[1]}
    return True, {"total": len(cases), "passed": len(cases)}


def _failure(res: ExecResult, want: Any, fn_name: str | None) -> tuple[str, str] | None:
    """(status, reason) when the run did not produce the expected output; None when it did."""
    if res.status != "ok":
        tail = res.stderr.strip().splitlines()[-1:] or [""]
        return res.status, tail[0][:200]
    if fn_name is None:
        return None if _stdout_matches(res.stdout, want) else ("wrong_answer", "stdout differs")
    try:
        got = json.loads(res.stdout)
    except ValueError:
        return "wrong_answer", "no result from the call"
    return None if _call_output_matches(got, want) else ("wrong_answer", "return value differs")


# --------------------------------------------------------------------------------------------------------
# The reward


class CodeReward:
    """Callable code reward `fn(prompt, completion, answer) -> RewardResult`; `answer` is the test spec.

    +1 when every test passes, −1 otherwise; −1 and malformed when no program can be extracted.
    `score_batch` scores many completions on a bounded thread pool (`workers` concurrent sandboxes); each
    run has a hard wall-clock kill, so no call blocks forever. Picklable (the pool is rebuilt lazily).

    Args:
        timeout_s: wall-clock and CPU limit per run (= per test case).
        memory_mb: address-space limit per process.
        max_output_bytes: cap on stdout and stderr of a run (exceeding it fails the test).
        workers: completions scored concurrently by `score_batch`.
        language: only "python" is executed for now.
        isolate_network: run in a new network namespace when the machine allows it (see `enforced`).
        max_procs: processes + threads per run (fork-bomb bound).
    """

    def __init__(self, timeout_s: float = 4.0, memory_mb: int = 512, max_output_bytes: int = 1 << 20,
                 workers: int = 2, language: str = "python", isolate_network: bool = True, max_procs: int = 16,
                 tmp_root: str | None = None):
        if language != "python":
            raise ValueError(f"CodeReward: language={language!r} is not supported yet (only 'python')")
        if workers < 1:
            raise ValueError(f"CodeReward: workers must be >= 1, got {workers}")
        self.limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                             max_procs=max_procs, isolate_network=isolate_network, tmp_root=tmp_root)
        self.language, self.workers = language, workers
        self.failures = 0  # sandbox errors and bad test specs seen by score_batch (scored malformed)
        self._pool: ThreadPoolExecutor | None = None
        caps = capabilities(self.limits.python)
        if isolate_network and not caps["netns"]:
            log.warning("CodeReward: no network namespace on this machine; programs can reach the network")
        if caps["root"] and not caps["setuid"]:
            log.warning("CodeReward: running as root but cannot switch uid; programs run as root")
        if not caps["ipcns"]:
            log.warning("CodeReward: no IPC namespace on this machine; programs share SysV IPC with the host")
        if not caps["seccomp"]:
            log.warning("CodeReward: no seccomp filter on this machine; programs can reach filesystem Unix sockets")

    @property
    def enforced(self) -> dict:
        """What isolation this reward's runs actually get on this machine."""
        caps = capabilities(self.limits.python)
        return {"network_isolated": self.limits.isolate_network and caps["netns"], "fresh_uid": caps["setuid"],
                "pid_namespace": caps["pidns"], "private_tmp": caps["mountns"], "ipc_namespace": caps["ipcns"],
                "unix_sockets_blocked": caps["seccomp"], "rlimits": caps["rlimits"],
                "limits": asdict(self.limits)}

    def __call__(self, prompt: str, completion: str, answer: Any) -> RewardResult:
        program = extract_program(completion, self.language)
        if program is None:
            return RewardResult(-1.0, True, "no program found")
        passed, details = check_tests(program, answer, self.limits)
        if passed:
            return RewardResult(1.0, False, f"passed {details['total']}/{details['total']}")
        return RewardResult(-1.0, False, f"failed case {details['failed_case']}: {details['status']} "
                                         f"({details['passed']}/{details['total']} passed) {details['reason']}")

    def score_batch(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]
    ) -> list[RewardResult]:
        """Scores all completions, `workers` at a time; a sandbox error or a bad spec is malformed, counted."""
        if not (len(prompts) == len(completions) == len(answers)):
            raise ValueError(f"score_batch: {len(prompts)} prompts, {len(completions)} completions, "
                             f"{len(answers)} answers")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="code-reward")
        futures = [self._pool.submit(self, p, c, a) for p, c, a in zip(prompts, completions, answers)]
        return [self._collect(f) for f in futures]

    def _collect(self, future) -> RewardResult:
        try:
            return future.result()  # bounded: every run inside has a hard kill
        except Exception as err:  # a sandbox error, a bad spec, a full disk: never the end of the run
            self.failures += 1
            log.warning("code reward failed (%s: %s); scored as malformed", type(err).__name__, err)
            return RewardResult(-1.0, True, f"error: {err}")

    def close(self) -> None:
        """Stops the worker pool (running sandboxes finish within their limits)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pool"] = None  # threads do not pickle; a copy makes its own pool
        return state
