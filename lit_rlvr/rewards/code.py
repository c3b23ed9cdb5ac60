"""Code reward: run the completion's program against the row's tests in a sandbox; +1 all pass, −1 otherwise.

Rules (docs/architecture.md §8, §10):

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
* Programs run in the code sandbox (lit_rlvr/rewards/sandbox/local.py: what it enforces on which machine), or
  on a SandboxFusion-compatible server with `sandbox_url` (lit_rlvr/rewards/sandbox/remote.py).
* A sandbox failure (the launcher itself broke, a server that cannot be reached) is not a wrong answer:
  `CodeReward.__call__` raises `SandboxError` so the reward runner counts it; `score_batch` scores it malformed
  and counts `failures`.

Only Python programs are executed for now (`language="python"`); `extract_program` knows other languages.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict
from typing import Any, Sequence

from lit_rlvr.config.errors import RewardOptionError, SandboxError, StopRequested
from lit_rlvr.rewards.base import RewardResult, wait_or_stop
from lit_rlvr.rewards.checks import is_int, is_number, problem_line
from lit_rlvr.rewards.sandbox.local import ExecResult, Limits, capabilities, run_program
from lit_rlvr.rewards.sandbox.remote import probe_sandbox, run_code_url, run_remote
from lit_rlvr.run.http import url_problem

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


def check_tests(source: str, spec: Any, limits: Limits | None = None, run: Any = None) -> tuple[bool, dict]:
    """Runs the program on each case in order, stopping at the first failure.

    Returns (all passed, details) with details `total`, `passed`, and on failure `failed_case`, `status`
    (the run's status, or "wrong_answer") and `reason`. Raises SandboxError if the sandbox itself breaks.
    """
    cases, fn_name = parse_tests(spec)
    run = run or run_program  # or a remote sandbox's (`run_on_server`)
    for i, (case_in, want) in enumerate(cases):
        if fn_name is None:
            stdin = "\n".join(map(str, case_in)) if isinstance(case_in, list) else str(case_in)
            res = run(source, stdin, limits=limits)
        else:
            res = run(source, json.dumps(_call_args(case_in)), limits=limits, fn_name=fn_name)
        if res.status == "sandbox_error":
            raise SandboxError(res.stderr.strip()[-500:])
        fail = _failure(res, want, fn_name)
        if fail is not None:
            return False, {"total": len(cases), "passed": i, "failed_case": i, "status": fail[0], "reason": fail[1]}
    return True, {"total": len(cases), "passed": len(cases)}


def run_on_server(url: str, source: str, stdin: str = "", *, limits: Limits, fn_name: str | None = None) -> ExecResult:
    """`run_program` on a SandboxFusion-compatible server (lit_rlvr/rewards/sandbox/remote.py)."""
    return ExecResult(*run_remote(url, source, stdin, limits=limits, fn_name=fn_name))


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


def sandbox_problems(url: Any, max_concurrent: Any, probe_timeout_s: float | None = None) -> list[str]:
    """The remote sandbox's settings; with `probe_timeout_s`, then one real run_code request (the start check)."""
    problems = [p for p in [url_problem(url, "reward.options.sandbox_url", "http://127.0.0.1:8080")] if p]
    if max_concurrent is not None and not is_int(max_concurrent, 1):
        problems.append(problem_line("reward.options.max_concurrent", max_concurrent, "an integer >= 1 (programs "
                                     "sent to the sandbox server at a time) or null (reward.options.workers)"))
    if problems or probe_timeout_s is None:
        return problems
    return [p for p in [probe_sandbox(url, probe_timeout_s)] if p]


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
                 tmp_root: str | None = None, sandbox_url: str | None = None, max_concurrent: int | None = None):
        if language != "python":
            raise ValueError(f"CodeReward: language={language!r} is not supported yet (only 'python')")
        if workers < 1:
            raise ValueError(f"CodeReward: workers must be >= 1, got {workers}")
        self.limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                             max_procs=max_procs, isolate_network=isolate_network, tmp_root=tmp_root)
        self.language, self.workers = language, workers
        self.failures = 0  # sandbox errors and bad test specs seen by score_batch (scored malformed)
        self._pool: ThreadPoolExecutor | None = None
        self._run = None  # the local sandbox's run_program
        if sandbox_url is not None:  # programs run on a server; max_concurrent requests in flight
            problems = sandbox_problems(sandbox_url, max_concurrent)
            if problems:
                raise RewardOptionError(problems)
            self._run = functools.partial(run_on_server, run_code_url(sandbox_url))
            self.workers = max_concurrent or workers
            return
        if max_concurrent is not None:
            raise RewardOptionError([f"reward.options.max_concurrent={max_concurrent!r} caps the requests to "
                                     "reward.options.sandbox_url, which is not set; the local sandbox runs "
                                     "reward.options.workers programs at a time"])
        caps = capabilities(self.limits.python)
        if isolate_network and not caps["netns"]:
            log.warning("CodeReward: no network namespace on this machine; programs can reach the network")
        if caps["root"] and not caps["setuid"]:
            log.warning("CodeReward: running as root but cannot switch uid; programs run as root")
        if not caps["ipcns"]:
            log.warning("CodeReward: no IPC namespace on this machine; programs share SysV IPC with the host")
        if not caps["seccomp"]:
            log.warning("CodeReward: no seccomp filter on this machine; programs can reach filesystem Unix sockets")

    @classmethod
    def check_options(cls, options: dict) -> list[str]:
        """Before any work: the remote sandbox's settings and one real request to its server."""
        if options.get("sandbox_url") is None:
            return []
        timeout_s = options.get("timeout_s", 4.0)
        return sandbox_problems(options["sandbox_url"], options.get("max_concurrent"),
                                float(timeout_s) if is_number(timeout_s) and timeout_s > 0 else 4.0)

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
        passed, details = check_tests(program, answer, self.limits, self._run)
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
        try:
            return [self._collect(f) for f in futures]
        except StopRequested:  # a stop past its grace: no new program starts; those running end at their limits
            pool, self._pool = self._pool, None
            pool.shutdown(wait=False, cancel_futures=True)
            raise

    def _collect(self, future: Future) -> RewardResult:
        wait_or_stop(lambda s: bool(wait([future], s).done), None)  # bounded: every run inside has a hard kill
        try:
            return future.result()
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
