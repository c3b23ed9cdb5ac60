"""Code reward: extraction, spec parsing, comparison, scoring, and hostile programs kept in their sandbox.

The hostile programs are written so that a successful attack makes them *pass* their test (they print the
secret they stole, or "PWNED"); containment is then a −1 score plus a check on the host afterwards (files
not written, no process left, the listener never reached). Run with `-s` to see the summary line.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import resource
import secrets
import shutil
import socket
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from typing import Callable

import pytest

from lit_rlvr.config.errors import SandboxError
from lit_rlvr.rewards import code
from lit_rlvr.rewards.sandbox import local as sandbox
from lit_rlvr.rewards.code import (
    CodeReward,
    Limits,
    capabilities,
    check_tests,
    extract_program,
    parse_tests,
    run_program,
)

_TALLY = {"tried": 0, "contained": 0, "notes": []}  # hostile programs, over all tests of this file
CAPS = capabilities()


def fence(src: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{src}\n```\nDone."


def stdin_spec(inp: str, out: str) -> dict:
    return {"inputs": [inp], "outputs": [out]}


def sandbox_procs() -> dict[int, int]:
    """pid → uid of every live process running under a sandbox uid."""
    found = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                uid = os.stat(f"/proc/{p}").st_uid
            except OSError:
                continue
            if sandbox._UID_BASE <= uid < sandbox._UID_BASE + sandbox._UID_SPAN:
                found[int(p)] = uid
    return found


def my_children() -> list[int]:
    """Live child processes of this (pytest) process."""
    kids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == os.getpid():
                kids.append(int(p))
    return kids


def wait_until_clean(timeout: float = 3.0) -> dict[int, int]:
    """Sandbox processes still alive after `timeout` (reaping is synchronous, the wait is only slack)."""
    deadline = time.monotonic() + timeout
    while (left := sandbox_procs()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# ------------------------------------------------------------------------------------------------------
# Extraction, parsing, comparison (no processes)


def test_extract_program_is_language_aware():
    text = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```text\noutput 2\n```"
    assert extract_program(text) == "print(2)\n"  # last python block; the trailing ```text block is skipped
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"  # untagged fallback
    assert extract_program("```python\nprint(1)\n```\n```\nraw\n```") == "print(1)\n"  # tagged beats untagged
    assert extract_program("  ```python3 title\n  x = 1\n  ```") == "  x = 1\n"  # indented fence, info string
    assert extract_program("```cpp\nint main(){}\n```") is None  # another language only
    assert extract_program("```cpp\nint main(){}\n```", language="cpp") == "int main(){}\n"
    assert extract_program("```python\nprint(1)") is None  # unclosed = truncated, not a program
    assert extract_program("no code at all") is None
    assert extract_program("```python\n\n```") is None  # empty block


def test_parse_tests_accepts_the_usual_formats():
    cases, fn = parse_tests({"inputs": ["1\n", "2\n"], "outputs": ["1\n", "4\n"]})
    assert cases == [("1\n", "1\n"), ("2\n", "4\n")] and fn is None
    cases, fn = parse_tests(json.dumps({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"}))
    assert cases == [([1, 2], 3)] and fn == "add"
    cases, fn = parse_tests([{"input": "a", "output": "b"}])
    assert cases == [("a", "b")] and fn is None
    cases, fn = parse_tests({"input_output": json.dumps({"inputs": ["x"], "outputs": ["y"]})})  # raw APPS row
    assert cases == [("x", "y")]
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_tests({"inputs": ["1", "2"], "outputs": ["1"]})
    with pytest.raises(ValueError, match="no test cases"):
        parse_tests({"inputs": [], "outputs": []})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_tests("{oops")


def test_output_comparison_rules():
    assert code._stdout_matches("1  2 \n3\n\n", "1 2\n3")  # whitespace-normalised, trailing blank lines
    assert code._stdout_matches("0.3333333\n", "0.33333333")  # numeric tokens within 1e-6
    assert not code._stdout_matches("1 2\n", "1\n2\n")  # line structure matters
    assert not code._stdout_matches("abc", "abd")
    assert code._call_output_matches([1, 2], (1, 2))  # tuples → lists
    assert code._call_output_matches(0.1 + 0.2, 0.3)
    assert code._call_output_matches(5, [5])  # APPS wraps outputs in a list
    assert code._call_output_matches([1, 2], "[1, 2]")  # LiveCodeBench writes outputs as JSON text
    assert code._call_output_matches({"1": 2}, {1: 2})  # JSON keys are strings
    assert not code._call_output_matches(True, 1)
    assert not code._call_output_matches(10**20 + 1, 10**20)  # big ints compared exactly
    assert code._call_args("[1, 2]\n3") == [[1, 2], 3]  # LiveCodeBench: one JSON value per line


def test_limits_and_reward_arguments_are_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="language='cpp'"):
        CodeReward(language="cpp")
    with pytest.raises(ValueError, match="workers"):
        CodeReward(workers=0)


# ------------------------------------------------------------------------------------------------------
# Scoring ordinary programs


def test_correct_programs_score_plus_one(tmp_path):
    reward = CodeReward(tmp_root=str(tmp_path))
    square = "n = int(input())\nprint(n * n)"
    spec = {"inputs": ["3\n", "12\n"], "outputs": ["9\n", "144\n"]}
    assert reward("p", fence(square), spec).score == 1.0
    assert reward("p", fence(square), json.dumps(spec)).score == 1.0  # JSON string spec
    assert reward("p", fence(square), [{"input": "5", "output": "25"}]).score == 1.0
    call_spec = {"inputs": [[[3, 1, 2]], [[]]], "outputs": [[1, 2, 3], []], "fn_name": "sort_it"}
    top_level = "def sort_it(xs):\n    print('noise')  # prints must not spoil the result\n    return tuple(sorted(xs))"
    assert reward("p", fence(top_level), call_spec).score == 1.0
    leetcode = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]"
    lcb_spec = {"inputs": ["[2, 7, 11]\n9"], "outputs": ["[0, 1]"], "fn_name": "twoSum"}
    result = reward("p", fence(leetcode), lcb_spec)
    assert result.score == 1.0 and not result.malformed and result.info == "passed 1/1"


def test_wrong_syntax_error_and_missing_program(tmp_path, monkeypatch):
    reward = CodeReward(tmp_root=str(tmp_path))
    spec = {"inputs": ["1", "2", "3"], "outputs": ["2", "4", "6"]}
    runs = []
    real_run = code.run_program
    monkeypatch.setattr(code, "run_program", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    wrong = reward("p", fence("print(int(input()) + 1)"), spec)  # right on case 0, wrong on case 1
    assert (wrong.score, wrong.malformed) == (-1.0, False) and "failed case 1: wrong_answer" in wrong.info
    assert len(runs) == 2  # stopped at the first failing case; case 2 never ran
    syntax = reward("p", fence("def f(:\n    pass"), spec)
    assert (syntax.score, syntax.malformed) == (-1.0, False) and "runtime_error" in syntax.info
    assert "SyntaxError" in syntax.info
    missing = reward("p", "I think the answer is 4.", spec)
    assert (missing.score, missing.malformed) == (-1.0, True)
    no_fn = reward("p", fence("def other(): pass"), {"inputs": [[1]], "outputs": [1], "fn_name": "f"})
    assert no_fn.score == -1.0 and "not defined" in no_fn.info


def test_check_tests_details_and_pickling(tmp_path):
    limits = Limits(timeout_s=2.0, tmp_root=str(tmp_path))
    ok, details = check_tests("print(input())", {"inputs": ["a", "b"], "outputs": ["a", "b"]}, limits)
    assert ok and details == {"total": 2, "passed": 2}
    ok, details = check_tests("raise SystemExit(3)", {"inputs": ["a"], "outputs": ["a"]}, limits)
    assert not ok and details["status"] == "runtime_error" and details["failed_case"] == 0
    reward = pickle.loads(pickle.dumps(CodeReward(tmp_root=str(tmp_path))))
    assert reward("p", fence("print(2)"), stdin_spec("", "2")).score == 1.0
    assert set(reward.enforced) >= {"network_isolated", "fresh_uid", "pid_namespace", "private_tmp"}


def test_fallback_paths_still_bound_the_program(tmp_path, monkeypatch):
    """Without namespaces (as on machines that lack them): still a hard kill, and no daemon survives."""
    degraded = dict(CAPS, netns=False, pidns=False, mountns=False)
    monkeypatch.setattr(sandbox, "capabilities", lambda python=None: degraded)
    if CAPS["setuid"]:  # without a private mount the sandbox uid needs a path it may traverse
        with pytest.raises(SandboxError, match="not traversable"):
            run_program("print(1)", limits=Limits(tmp_root=str(tmp_path)))  # pytest's tmp dirs are 0700
    runs = tempfile.mkdtemp(prefix="lit_rlvr_test_")
    os.chmod(runs, 0o711)
    try:
        check_degraded(Limits(timeout_s=1.0, tmp_root=runs))
        assert not os.listdir(runs)
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def check_degraded(limits: Limits) -> None:
    """Output, the wall-clock kill, and (with a fresh uid) the sweep of a daemon that left the group."""
    assert run_program("print(input()[::-1])", "abc", limits=limits).stdout == "cba\n"
    assert run_program("while True: pass", limits=limits).status == "timeout"
    if CAPS["setuid"]:  # the kill-all-by-uid sweep is what catches a daemon without a pid namespace
        daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('parent done')"
        assert run_program(daemon, limits=limits).status == "ok"
        assert not wait_until_clean(), "a setsid daemon survived the fallback sweep"


# ------------------------------------------------------------------------------------------------------
# Hostile programs


def tally(name: str, contained: bool, note: str = "") -> None:
    _TALLY["tried"] += 1
    _TALLY["contained"] += bool(contained)
    if not contained or note:
        _TALLY["notes"].append(f"{name}: {'contained' if contained else 'NOT CONTAINED'} {note}".strip())


def test_network_is_unreachable(tmp_path):
    if not CAPS["netns"]:
        pytest.skip("no network namespace on this machine (needs root or CAP_SYS_ADMIN): network not isolated")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    hits = []

    def accept_loop(stop):
        while not stop.is_set():
            try:
                hits.append(server.accept()[0])
            except OSError:
                pass

    stop = threading.Event()
    listener = threading.Thread(target=accept_loop, args=(stop,), daemon=True)
    listener.start()
    prog = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', int(input())), timeout=1)\n"
            "    print('PWNED')\nexcept OSError as err:\n    print('blocked', err)")
    try:
        spec = stdin_spec(str(server.getsockname()[1]), "PWNED")
        result = CodeReward(timeout_s=3.0, tmp_root=str(tmp_path))("p", fence(prog), spec)
    finally:
        stop.set()
        listener.join(2)
        server.close()
    contained = result.score == -1.0 and not hits
    tally("network", contained)
    assert contained, (result, hits)


@dataclass
class Hostile:
    name: str
    program: str
    spec: dict
    host_check: Callable[[], bool] | None = None  # extra containment check on the host, after the batch
    expect_status: str | None = None  # the run status containment must show (in the reward's info)
    missing: str | None = None  # why this machine cannot contain it (then it is not run at all)


# What contains each attack. Root without a uid switch ignores RLIMIT_NPROC, so a fork bomb is not even
# started there; a non-root user has its own uid barrier against root's files.
NOT_ROOT_PROGRAM = CAPS["setuid"] or not CAPS["root"]
PRIVATE_TMP = CAPS["mountns"]


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """The attacks, with a secret env var in the parent, a 0600 file, and cleanup of anything that escaped."""
    secret_env = "env-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("LIT_RLVR_TEST_SECRET", secret_env)
    # Outside /tmp when possible (/run is not one of the sandbox's private dirs), so the path is visible
    # and only the uid barrier stands between the program and the file.
    base = pathlib.Path("/run") if os.access("/run", os.W_OK) else tmp_path
    private = pathlib.Path(tempfile.mkdtemp(prefix="lit_rlvr_private_", dir=base))
    private.chmod(0o700)
    key = private / "key.txt"
    key.write_text("file-secret-" + secrets.token_hex(8))
    key.chmod(0o600)
    token = secrets.token_hex(6)
    shared_tmp = [f"{d}/lit_rlvr_pwned_{token}" for d in ("/tmp", "/var/tmp", "/dev/shm")]
    targets = [str(private / "pwned"), f"/root/lit_rlvr_pwned_{token}", os.path.join(os.getcwd(), f"pwned_{token}")]
    targets += shared_tmp if PRIVATE_TMP else []  # world-writable: only a private mount keeps them clean
    me = str(os.getpid())
    try:
        yield attacks(key, targets, secret_env, me)
    finally:
        for t in targets + shared_tmp:  # never leave an escaped write behind, even when the test fails
            if os.path.exists(t):
                os.remove(t)
        shutil.rmtree(private, ignore_errors=True)


def attacks(key: pathlib.Path, targets: list[str], secret_env: str, me: str) -> list[Hostile]:
    """Each attack that works makes its program pass its test (it prints the loot or "PWNED")."""
    no_host_files = lambda: not [t for t in targets if os.path.exists(t)]
    nothing_left = lambda: not wait_until_clean()
    uid_barrier = None if CAPS["setuid"] else "no uid switch: the program runs as the test's own user"
    not_root = None if NOT_ROOT_PROGRAM else "the program runs as root"
    return [
        Hostile("infinite loop", P("while True:\n    pass"), stdin_spec("", "1"), expect_status="timeout"),
        Hostile("memory bomb", P("""
            hog = []
            while True:
                hog.append(bytearray(64 << 20))
            """), stdin_spec("", "1"), expect_status="memory"),
        Hostile("fork bomb", P("""
            import os, time
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.001)
            """), stdin_spec("", "1"), nothing_left, "timeout",
                None if NOT_ROOT_PROGRAM else "root without a uid switch ignores RLIMIT_NPROC"),
        Hostile("huge output", P("""
            import sys
            while True:
                sys.stdout.write('x' * 65536)
            """), stdin_spec("", "x"), expect_status="output_limit"),
        Hostile("disk fill", P("""
            with open('big.bin', 'wb') as f:
                for _ in range(256):
                    f.write(b'0' * (1 << 20))
            print('PWNED')
            """), stdin_spec("", "PWNED")),
        Hostile("write outside its dir", P(f"""
            for path in {targets!r}:
                try:
                    open(path, 'w').write('pwned')
                except OSError:
                    pass
            print('done')
            """), stdin_spec("", "nothing"), no_host_files, missing=uid_barrier),
        Hostile("read 0600 file", P(f"print(open({str(key)!r}).read())"), stdin_spec("", key.read_text()),
                missing=uid_barrier),
        Hostile("read /etc/shadow", P("print(open('/etc/shadow').readline() and 'PWNED')"), stdin_spec("", "PWNED"),
                missing=not_root),
        Hostile("list /root", P("import os\nos.listdir('/root')\nprint('PWNED')"), stdin_spec("", "PWNED"),
                missing=not_root),
        Hostile("steal env secret", P("""
            import glob, os
            found = os.environ.get('LIT_RLVR_TEST_SECRET', '')
            for path in glob.glob('/proc/*/environ'):  # the trainer's environment, if it can see it
                try:
                    data = open(path, 'rb').read()
                except OSError:
                    continue
                for kv in data.split(bytes(1)):
                    if kv.startswith(b'LIT_RLVR_TEST_SECRET='):
                        found = kv.split(b'=', 1)[1].decode()
            print(found or 'none')
            """), stdin_spec("", secret_env)),
        Hostile("signal the trainer", P("""
            import os
            try:
                os.kill(int(input()), 0)  # signal 0: the permission check, without harming the test
                print('PWNED')
            except OSError:
                print('no')
            """), stdin_spec(me, "PWNED"),
                missing=None if CAPS["setuid"] or CAPS["pidns"] else "same uid, same pid namespace"),
        Hostile("see the trainer's process",
                P("import os\nprint('PWNED' if os.path.exists('/proc/' + input()) else 0)"),
                stdin_spec(me, "PWNED"), missing=None if CAPS["pidns"] else "no pid namespace"),
        Hostile("inherited fds", P("""
            import os
            open_fds = []
            for fd in range(3, 1024):
                try:
                    os.fstat(fd)
                    open_fds.append(fd)
                except OSError:
                    pass
            print('PWNED' if open_fds else 'clean')
            """), stdin_spec("", "PWNED")),
        # Its parent exits with the right answer (so it scores +1); containment is the daemon's death.
        Hostile("orphan daemon", P("""
            import os, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(60)
                os._exit(0)
            print(1)
            """), stdin_spec("", "1"), nothing_left,
                missing=None if CAPS["setuid"] or CAPS["pidns"] else "no pid namespace and no uid sweep"),
    ]


def P(src: str) -> str:
    """A program from an indented triple-quoted string."""
    return textwrap.dedent(src).strip("\n")


class PeakProcs:
    """Samples, in a thread, the most live processes any one sandbox uid had at once (fork-bomb reach)."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            counts = {}
            for uid in sandbox_procs().values():
                counts[uid] = counts.get(uid, 0) + 1
            self.peak = max([self.peak, *counts.values()])
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(2)


def test_hostile_programs_are_contained(hostile, tmp_path):
    runs_root = tmp_path / "runs"
    runs_root.mkdir()
    progs = [h for h in hostile if h.missing is None]
    reward = CodeReward(timeout_s=2.0, memory_mb=256, workers=2, max_procs=16, tmp_root=str(runs_root))
    fds_before = len(os.listdir("/proc/self/fd"))
    # children an earlier test in this worker left on purpose (multiprocessing's resource tracker) are not ours
    children_before = set(my_children())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with PeakProcs() as procs:
        try:
            results = reward.score_batch(["p"] * len(progs), [fence(h.program) for h in progs], [h.spec for h in progs])
        finally:
            reward.close()
    batch_s = time.monotonic() - t0

    for h, result in zip(progs, results):
        contained = result.score == -1.0 or h.name == "orphan daemon"
        contained &= h.expect_status is None or h.expect_status in result.info
        contained &= h.host_check is None or h.host_check()
        tally(h.name, contained, "" if contained else result.info)
    for h in hostile:
        if h.missing is not None:
            _TALLY["notes"].append(f"{h.name}: skipped ({h.missing})")
    print(f"\nhostile programs tried: {_TALLY['tried']}, contained: {_TALLY['contained']} "
          f"(batch {batch_s:.1f}s, fork bomb peak {procs.peak} procs/run; fresh uid={CAPS['setuid']} "
          f"pidns={CAPS['pidns']} netns={CAPS['netns']} private tmp={CAPS['mountns']})")
    for note in _TALLY["notes"]:
        print("  ", note)

    assert _TALLY["tried"] == _TALLY["contained"], _TALLY["notes"]
    assert not wait_until_clean() and not set(my_children()) - children_before, "processes left after the batch"
    assert not os.listdir(runs_root), "run directories left after the batch"
    assert procs.peak <= 16  # RLIMIT_NPROC per run (a fresh uid per run)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no descriptor leaked into the trainer
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000  # KiB: outputs stayed capped
    assert reward.failures == 0
