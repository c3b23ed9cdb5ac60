"""The code reward's programs run by a SandboxFusion-compatible server (`reward.options.sandbox_url`, verl's
`sandbox_fusion.url`) instead of the local sandbox: POST `{code, language, stdin, run_timeout, memory_limit_MB}`
to its `run_code` endpoint, answered `{status, run_result: {status, return_code, stdout, stderr, ...}}`.

A call-based test (`fn_name`) is sent as one self-contained program: it writes the solution to `solution.py` and
runs the local sandbox's harness (lit_rlvr/rewards/sandbox/harness.py) on it. What the server answers maps to
the local sandbox's statuses (`ExecResult`); a server that cannot be reached, fails or answers garbage is a
`sandbox_error` (the completion is malformed and counted, never a wrong answer). The HTTP rules are
lit_rlvr/run/http.py's (no redirect, a bounded answer, one deadline per request); an answer over the bound can only
be the program's output, so it is the run's `output_limit`.
"""

from __future__ import annotations

import functools
import time
import urllib.parse
from pathlib import Path
from typing import Any, Optional

from lit_rlvr.config.errors import HTTPRefusal
from lit_rlvr.run.http import DEFAULT_MAX_RESPONSE_BYTES, HTTPClient, redact, start_problem

HARNESS = Path(__file__).with_name("harness.py")
_HTTP_GRACE_S = 30.0  # the server's own overhead (queueing, container start) beyond the run's time limit
_PROBE = {"code": "print(1)", "language": "python", "stdin": "", "run_timeout": 4.0, "memory_limit_MB": 512}


def answer_bound(max_output_bytes: int) -> int:
    """The bytes of an answer: stdout and stderr of up to `max_output_bytes` each, JSON-escaped (up to 6 bytes per
    byte), plus the rest of the answer."""
    return DEFAULT_MAX_RESPONSE_BYTES + 12 * int(max_output_bytes)


def run_code_url(url: str) -> str:
    """A URL without a path gets SandboxFusion's `/run_code`."""
    parts = urllib.parse.urlsplit(url)
    return url if parts.path not in ("", "/") else urllib.parse.urlunsplit(parts._replace(path="/run_code"))


@functools.lru_cache(maxsize=8)
def _client(timeout_s: float, max_response_bytes: int, retries: int, backoff_s: float) -> HTTPClient:
    """One client per setting (its connections kept alive across the runs of a reward)."""
    return HTTPClient(timeout_s, max_response_bytes, retries, backoff_s,
                      size_key="the bound from reward.options.max_output_bytes")


def call_program(source: str, fn_name: str) -> str:
    """One program that runs the harness on `source` (the local sandbox copies the two files instead)."""
    return (f"open('solution.py', 'w').write({source!r})\nimport sys\nsys.argv = ['_harness.py', {fn_name!r}]\n"
            + HARNESS.read_text())


def run_remote(url: str, source: str, stdin: str = "", *, limits: Any, fn_name: Optional[str] = None,
               retries: int = 2, backoff_s: float = 0.5) -> tuple:
    """`run_program`'s contract on the server at `url`: the fields of an `ExecResult` (sandbox/local.py)."""
    code = call_program(source, fn_name) if fn_name else source
    body = {"code": code, "language": "python", "stdin": stdin, "run_timeout": limits.timeout_s,
            "memory_limit_MB": limits.memory_mb}
    client = _client(limits.timeout_s + _HTTP_GRACE_S, answer_bound(limits.max_output_bytes), retries, backoff_s)
    start = time.monotonic()
    try:
        answer = client.post_json(url, body)
        run = answer.get("run_result") or {}
        status, stdout, stderr = answer["status"], str(run.get("stdout") or ""), str(run.get("stderr") or "")
        code_, run_status = run.get("return_code"), run.get("status")
    except HTTPRefusal as err:
        if err.kind == "size":  # only the program's output can make it that large
            return ("output_limit", "", f"sandbox server: {err}", None, time.monotonic() - start)
        return ("sandbox_error", "", f"sandbox server: {err}", None, time.monotonic() - start)
    except Exception as err:  # not JSON, not SandboxFusion's shape
        return ("sandbox_error", "", f"sandbox server {redact(url)}: {type(err).__name__}: {redact(err)[:300]}",
                None, time.monotonic() - start)
    wall = float(run.get("execution_time") or time.monotonic() - start)
    if status == "SandboxError" or run_status is None:
        return ("sandbox_error", stdout, f"sandbox server {redact(url)}: {redact(answer.get('message', status))}",
                None, wall)
    cap = limits.max_output_bytes
    if len(stdout.encode()) > cap or len(stderr.encode()) > cap:
        verdict = "output_limit"
    elif run_status == "TimeLimitExceeded":
        verdict = "timeout"
    elif code_ != 0 and "MemoryError" in stderr[-4096:]:
        verdict = "memory"
    elif code_ != 0 or run_status != "Finished":
        verdict = "runtime_error"
    else:
        verdict = "ok"
    return (verdict, stdout, stderr, code_ if isinstance(code_, int) else None, wall)


def probe_sandbox(url: str, timeout_s: float = 4.0) -> Optional[str]:
    """The start check: one real `run_code` request (`print(1)`) to the endpoint of the setting `url`; None when
    the server answers it in SandboxFusion's shape, else the line why not (naming the setting and the URL,
    credentials redacted)."""
    key = "reward.options.sandbox_url"
    try:
        answer = HTTPClient(timeout_s + _HTTP_GRACE_S).post_json(run_code_url(url), _PROBE)
    except Exception as err:
        return start_problem(key, url, err)
    if not isinstance(answer, dict) or "status" not in answer or "run_result" not in answer:
        return (f"{key}={redact(url)!r}: the start check's run_code request was answered {repr(answer)[:120]}, "
                "not SandboxFusion's {status, run_result}")
    return None
