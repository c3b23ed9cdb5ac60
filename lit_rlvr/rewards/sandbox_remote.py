"""The code reward's programs run by a SandboxFusion-compatible server (`reward.options.sandbox_url`, verl's
`sandbox_fusion.url`) instead of the local sandbox: POST `{code, language, stdin, run_timeout, memory_limit_MB}`
to its `run_code` endpoint, answered `{status, run_result: {status, return_code, stdout, stderr, ...}}`.

A call-based test (`fn_name`) is sent as one self-contained program: it writes the solution to `solution.py` and
runs the local sandbox's harness (lit_rlvr/rewards/sandbox_harness.py) on it. What the server answers maps to
the local sandbox's statuses (`ExecResult`); a server that cannot be reached, fails or answers garbage is a
`sandbox_error` (the completion is malformed and counted, never a wrong answer).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path
from typing import Any, Optional

from lit_rlvr.rewards.remote import post_json

HARNESS = Path(__file__).with_name("sandbox_harness.py")
_HTTP_GRACE_S = 30.0  # the server's own overhead (queueing, container start) beyond the run's time limit


def run_code_url(url: str) -> str:
    """A URL without a path gets SandboxFusion's `/run_code`."""
    parts = urllib.parse.urlsplit(url)
    return url if parts.path not in ("", "/") else urllib.parse.urlunsplit(parts._replace(path="/run_code"))


def call_program(source: str, fn_name: str) -> str:
    """One program that runs the harness on `source` (the local sandbox copies the two files instead)."""
    return (f"open('solution.py', 'w').write({source!r})\nimport sys\nsys.argv = ['_harness.py', {fn_name!r}]\n"
            + HARNESS.read_text())


def run_remote(url: str, source: str, stdin: str = "", *, limits: Any, fn_name: Optional[str] = None,
               retries: int = 2, backoff_s: float = 0.5) -> tuple:
    """`run_program`'s contract on the server at `url`: the fields of an `ExecResult` (lit_rlvr.rewards.code)."""
    code = call_program(source, fn_name) if fn_name else source
    body = json.dumps({"code": code, "language": "python", "stdin": stdin, "run_timeout": limits.timeout_s,
                       "memory_limit_MB": limits.memory_mb}).encode()
    start = time.monotonic()
    try:
        answer = post_json(url, body, limits.timeout_s + _HTTP_GRACE_S, retries, backoff_s)
        run = answer.get("run_result") or {}
        status, stdout, stderr = answer["status"], str(run.get("stdout") or ""), str(run.get("stderr") or "")
        code_, run_status = run.get("return_code"), run.get("status")
    except Exception as err:  # unreachable, 5xx after retries, not JSON, not SandboxFusion's shape
        return ("sandbox_error", "", f"sandbox server {url}: {type(err).__name__}: {str(err)[:300]}",
                          None, time.monotonic() - start)
    wall = float(run.get("execution_time") or time.monotonic() - start)
    if status == "SandboxError" or run_status is None:
        return ("sandbox_error", stdout, f"sandbox server {url}: {answer.get('message', status)}", None,
                          wall)
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
