"""The code reward's sandbox launcher: a stdlib-only script run by path as `python -I -S launcher.py MODE
CONFIG` as the training process's user (`lit_rlvr.rewards.sandbox.local` starts it; never imported). It is a fresh
single-threaded interpreter, so forking, unsharing and dropping privileges are safe there (a `preexec_fn` in the
multi-threaded trainer could deadlock)."""
import ctypes
import json
import os
import resource
import signal
import sys
import time

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
