"""`reward=remote`: a reward server by URL, speaking OpenRLHF's protocol (`--remote_rm_url`), so their reward
servers work unchanged.

One request scores a chunk of `batch_size` completions: POST `url` with the JSON body
`{"query": [prompt + completion, ...], "prompts": [prompt, ...], "labels": [answer, ...]}`, answered with
`{"rewards": [number, ...]}` (`score_key` names another key; OpenRLHF's servers also send `scores`). A URL without a
path gets `/get_reward`. At most `max_concurrent` requests are in flight; each has `timeout_s` seconds; a
connection error or a 5xx answer is retried `retries` times with exponential back-off from `backoff_s`. A chunk
that still fails, times out, or is answered with anything but one number per completion makes only its own
completions malformed and counted (each number goes through the reward contract: docs/rewards.md); the run goes
on. The HTTP rules are lit_rlvr/run/http.py's: no redirect followed, answers up to `max_response_bytes`, each
request one deadline of `timeout_s`, the URL's credentials never in a message. The start check (`check_options`)
sends one real request of the run's kind and stops the run before any work, in one line naming the URL, when it
fails: unreachable, refused credentials, TLS to a plain server, a redirect, an answer of another shape.
"""

from __future__ import annotations

import logging
import urllib.parse
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Optional, Sequence

from lit_rlvr.config.errors import HTTPRefusal, RewardOptionError, StopRequested
from lit_rlvr.rewards.base import RewardResult, wait_or_stop
from lit_rlvr.rewards.checks import is_int, is_number, problem_line
from lit_rlvr.rewards.options import RUNNER_KEYS
from lit_rlvr.run.http import DEFAULT_MAX_RESPONSE_BYTES, HTTPClient, redact, start_problem, url_problem

log = logging.getLogger(__name__)

OPTIONS = ("url", "batch_size", "max_concurrent", "timeout_s", "retries", "backoff_s", "score_key",
           "max_response_bytes")
# the start check's request: `batch_size` copies of this completion, the shape and size of every request of the run
# (a server that takes one completion and refuses a full chunk passed a one-completion probe; the run then failed
# every chunk)
PROBE = {"query": ["1+1=2"], "prompts": ["1+1="], "labels": ["2"]}


def endpoint(url: Any) -> str:
    """The URL requests go to: a URL without a path gets OpenRLHF's `/get_reward`."""
    parts = urllib.parse.urlsplit(str(url))
    return url if parts.path not in ("", "/") else urllib.parse.urlunsplit(parts._replace(path="/get_reward"))


class RemoteReward:
    """Scores batches on a reward server (see the module docstring). `score_batch` returns one result per
    completion; a failed chunk's are results whose info starts with "error" (the runner counts them)."""

    def __init__(self, url: str, batch_size: int = 64, max_concurrent: int = 4, timeout_s: float = 30.0,
                 retries: int = 3, backoff_s: float = 0.5, score_key: str = "rewards",
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
        problems = [p for p in [url_problem(url, "reward.options.url", "http://127.0.0.1:5000/get_reward")] if p]
        for key, value, ok, expected in (
                ("batch_size", batch_size, is_int(batch_size, 1), "an integer >= 1 (completions per request)"),
                ("max_concurrent", max_concurrent, is_int(max_concurrent, 1), "an integer >= 1 (requests in flight)"),
                ("timeout_s", timeout_s, is_number(timeout_s) and timeout_s > 0, "a number > 0 (seconds a request)"),
                ("retries", retries, is_int(retries, 0), "an integer >= 0"),
                ("backoff_s", backoff_s, is_number(backoff_s) and backoff_s >= 0, "a number >= 0"),
                ("score_key", score_key, isinstance(score_key, str) and score_key, "the answer's key of the scores"),
                ("max_response_bytes", max_response_bytes, is_int(max_response_bytes, 1),
                 "an integer >= 1 (bytes of one answer)")):
            if not ok:
                problems.append(problem_line(f"reward.options.{key}", value, expected))
        if problems:
            raise RewardOptionError(problems)
        self.url, self.batch_size, self.max_concurrent = endpoint(url), batch_size, max_concurrent
        self.timeout_s, self.retries, self.backoff_s, self.score_key = float(timeout_s), retries, backoff_s, score_key
        self.client = HTTPClient(timeout_s, max_response_bytes, retries, backoff_s,
                                 size_key="reward.options.max_response_bytes")
        self._pool: Optional[ThreadPoolExecutor] = None

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> list[str]:
        """Before any work: the settings, then one real request of the run's kind, whose answer must be
        {score_key: [one number]} (one line naming the URL when it is not)."""
        if "url" not in options:
            return ["reward=remote needs reward.options.url, the reward server's URL (e.g. "
                    "http://127.0.0.1:5000/get_reward)"]
        try:
            reward = cls(**{k: v for k, v in options.items() if k in OPTIONS})
        except RewardOptionError as err:
            return list(err.problems)
        if any(k not in OPTIONS and k not in RUNNER_KEYS for k in options):  # a typo: no request until it is fixed
            return []  # (reward_problems names the unknown key)
        return [p for p in [reward.probe(options["url"])] if p]

    def probe(self, given: str) -> Optional[str]:
        """The start check's request: None when the server answers it as the run needs, else the line why not
        (naming the setting's value `given`)."""
        try:
            answer = self.client.post_json(self.url, {k: v * self.batch_size for k, v in PROBE.items()})
        except Exception as err:
            return start_problem("reward.options.url", given, err)
        scores = answer.get(self.score_key) if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != self.batch_size:
            return (f"reward.options.url={redact(given)!r}: the start check's request was answered "
                    f"{_short(answer)}, not {{{self.score_key!r}: [one number per completion]}} (a reward server "
                    "of OpenRLHF's protocol? reward.options.score_key names the answer's key)")
        return None

    def __call__(self, prompt: Any, completion: str, answer: Any) -> RewardResult:
        return self.score_batch([prompt], [completion], [answer])[0]

    def score_batch(self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any]) -> list:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="reward-remote")
        starts = range(0, len(completions), self.batch_size)
        chunks = [(prompts[i:i + self.batch_size], completions[i:i + self.batch_size], answers[i:i + self.batch_size])
                  for i in starts]
        results: list = []
        try:
            for future in [self._pool.submit(self._score_chunk, *c) for c in chunks]:
                # each request has its deadline; a chunk that close() cancelled is never 'done' to wait()
                wait_or_stop(lambda s, f=future: f.cancelled() or bool(wait([f], s).done), None)
                results.extend(future.result())
        except StopRequested:  # a stop past its grace: no request left waits for its server
            pool, self._pool = self._pool, None
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        return results

    def _score_chunk(self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any]) -> list:
        body = {"query": [_text(p) + c for p, c in zip(prompts, completions)], "prompts": list(prompts),
                "labels": list(answers)}
        try:
            answer = self._post(body)
            scores = answer.get(self.score_key) if isinstance(answer, dict) else None
            if not isinstance(scores, list) or len(scores) != len(completions):
                raise ValueError(f"the server answered {_short(answer)}: expected {{{self.score_key!r}: [one number "
                                 f"per completion ({len(completions)})]}}")
        except Exception as err:
            detail = (str(err) if isinstance(err, HTTPRefusal)
                      else f"{redact(self.url)}: {type(err).__name__}: {redact(err)}")
            why = f"error: reward server {detail[:400]}"
            log.warning("%s (the request's %d completions scored as malformed)", why[7:], len(completions))
            return [RewardResult(-1.0, True, why)] * len(completions)
        return scores  # each one through the reward contract (a str or None is malformed)

    def _post(self, body: dict) -> Any:
        return self.client.post_json(self.url, body)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}


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
