"""`reward=remote`: a reward server by URL, speaking OpenRLHF's protocol (`--remote_rm_url`), so their reward
servers work unchanged.

One request scores a chunk of `batch_size` completions: POST `url` with the JSON body
`{"query": [prompt + completion, ...], "prompts": [prompt, ...], "labels": [answer, ...]}`, answered with
`{"rewards": [number, ...]}` (`score_key` names another key; OpenRLHF's servers also send `scores`). A URL without a
path gets `/get_reward`. At most `max_concurrent` requests are in flight; each has `timeout_s` seconds; a
connection error or a 5xx answer is retried `retries` times with exponential back-off from `backoff_s`. A chunk
that still fails, times out, or is answered with anything but one number per completion makes only its own
completions malformed and counted (each number goes through the reward contract: docs/rewards.md); the run goes
on. A server that cannot be reached when the run starts stops it before any work, in one line naming the URL.
The standard library's HTTP client only: no extra package.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.rewards.base import RewardResult
from lit_rlvr.rewards.checks import is_int, is_number, problem_line

log = logging.getLogger(__name__)

_PROBE_S = 5.0  # seconds to open a connection at start


def endpoint(url: Any) -> str:
    """The URL requests go to: a URL without a path gets OpenRLHF's `/get_reward`."""
    parts = urllib.parse.urlsplit(str(url))
    return url if parts.path not in ("", "/") else urllib.parse.urlunsplit(parts._replace(path="/get_reward"))


def url_problem(url: Any, key: str = "reward.options.url", probe: bool = True) -> Optional[str]:
    """A line when `url` is not an http(s) URL, or (with `probe`) no connection to its host and port opens."""
    if not isinstance(url, str) or not url:
        return problem_line(key, url, "the reward server's http:// or https:// URL")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return problem_line(key, url, "an http:// or https:// URL with a host (e.g. http://127.0.0.1:5000/get_reward)")
    if not probe:
        return None
    try:
        socket.create_connection((parts.hostname, port), timeout=_PROBE_S).close()
    except OSError as err:
        return (f"{key}={url!r}: the server cannot be reached ({type(err).__name__}: {err}); start it first, or "
                "fix the URL")
    return None


class RemoteReward:
    """Scores batches on a reward server (see the module docstring). `score_batch` returns one result per
    completion; a failed chunk's are results whose info starts with "error" (the runner counts them)."""

    def __init__(self, url: str, batch_size: int = 64, max_concurrent: int = 4, timeout_s: float = 30.0,
                 retries: int = 3, backoff_s: float = 0.5, score_key: str = "rewards", probe: bool = True):
        problems = [p for p in [url_problem(url, probe=probe)] if p]
        for key, value, ok, expected in (
                ("batch_size", batch_size, is_int(batch_size, 1), "an integer >= 1 (completions per request)"),
                ("max_concurrent", max_concurrent, is_int(max_concurrent, 1), "an integer >= 1 (requests in flight)"),
                ("timeout_s", timeout_s, is_number(timeout_s) and timeout_s > 0, "a number > 0 (seconds a request)"),
                ("retries", retries, is_int(retries, 0), "an integer >= 0"),
                ("backoff_s", backoff_s, is_number(backoff_s) and backoff_s >= 0, "a number >= 0"),
                ("score_key", score_key, isinstance(score_key, str) and score_key, "the answer's key of the scores")):
            if not ok:
                problems.append(problem_line(f"reward.options.{key}", value, expected))
        if problems:
            raise RewardOptionError(problems)
        self.url, self.batch_size, self.max_concurrent = endpoint(url), batch_size, max_concurrent
        self.timeout_s, self.retries, self.backoff_s, self.score_key = float(timeout_s), retries, backoff_s, score_key
        self._pool: Optional[ThreadPoolExecutor] = None

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> list[str]:
        """Before any work: the settings and whether the server can be reached (one line naming the URL)."""
        if "url" not in options:
            return ["reward=remote needs reward.options.url, the reward server's URL (e.g. "
                    "http://127.0.0.1:5000/get_reward)"]
        try:
            cls(**{k: v for k, v in options.items() if k in ("url", "batch_size", "max_concurrent", "timeout_s",
                                                                 "retries", "backoff_s", "score_key", "probe")})
        except RewardOptionError as err:
            return list(err.problems)
        return []

    def __call__(self, prompt: Any, completion: str, answer: Any) -> RewardResult:
        return self.score_batch([prompt], [completion], [answer])[0]

    def score_batch(self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any]) -> list:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="reward-remote")
        starts = range(0, len(completions), self.batch_size)
        chunks = [(prompts[i:i + self.batch_size], completions[i:i + self.batch_size], answers[i:i + self.batch_size])
                  for i in starts]
        results: list = []
        for chunk, future in zip(chunks, [self._pool.submit(self._score_chunk, *c) for c in chunks]):
            results.extend(future.result())
        return results

    def _score_chunk(self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any]) -> list:
        body = json.dumps({"query": [_text(p) + c for p, c in zip(prompts, completions)], "prompts": list(prompts),
                           "labels": list(answers)}, default=str).encode()
        try:
            answer = self._post(body)
            scores = answer.get(self.score_key) if isinstance(answer, dict) else None
            if not isinstance(scores, list) or len(scores) != len(completions):
                raise ValueError(f"the server answered {_short(answer)}: expected {{{self.score_key!r}: [one number "
                                 f"per completion ({len(completions)})]}}")
        except Exception as err:
            why = f"error: reward server {self.url}: {type(err).__name__}: {str(err)[:300]}"
            log.warning("%s (the request's %d completions scored as malformed)", why[7:], len(completions))
            return [RewardResult(-1.0, True, why)] * len(completions)
        return scores  # each one through the reward contract (a str or None is malformed)

    def _post(self, body: bytes) -> Any:
        return post_json(self.url, body, self.timeout_s, self.retries, self.backoff_s)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}


def post_json(url: str, body: bytes, timeout_s: float, retries: int, backoff_s: float) -> Any:
    """POST `body` (JSON) to `url` and decode the JSON answer; connection errors and 5xx are retried `retries`
    times with back-off from `backoff_s` (doubling); a timeout is not (the next try would wait as long again)."""
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            if err.code < 500 or attempt == retries:
                raise
        except (urllib.error.URLError, ConnectionError) as err:
            if isinstance(getattr(err, "reason", None), TimeoutError) or attempt == retries:
                raise
        time.sleep(backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")


def _text(prompt: Any) -> str:
    """A chat prompt (a list of messages) as text for `query`: its contents, one after another."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return str(prompt)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:100] + "..."
