"""`reward=judge`: an LLM judge over an OpenAI-compatible chat API (`vllm serve`, SGLang, a hosted API) with the
`openai` client (`pip install 'lit-rlvr[judge]'`).

    python train.py reward=judge reward.options.base_url=http://127.0.0.1:8000/v1 reward.options.model=Qwen/...

The judge sees `template` filled with `{prompt}`, `{completion}` and `{answer}` as one user message. Two scores:

- `score: yes_prob` (default): one token, with log-probs; the score is P(yes) / (P(yes) + P(no)) over the top
  `top_logprobs` candidates, in [0, 1], with no text to parse. A candidate counts as yes (no) when, stripped and
  lower-cased, it is "yes" ("no") or the start of it: a tokenizer may split the word, and the first token is all
  one step returns. Neither among the candidates: malformed (score 0).
- `score: parsed`: up to `max_tokens` tokens of text; the last number in it divided by `max_score`, clipped to
  [0, 1]. No number: malformed (score 0).

The judge is an async reward: its calls are awaited under `reward.options.max_concurrent` and bounded by
`reward.options.timeout_s` (lit_rlvr/rewards/async_runner.py); an error from the API (connection, 5xx after the
client's `retries`) makes that completion malformed and counted. The client's HTTP follows lit_rlvr/run/http.py's
rules (no redirect followed: prompts, completions and reference answers go to `base_url`'s host only; answers up
to `max_response_bytes`). The API key comes from the environment (`api_key_env`, OPENAI_API_KEY by default) or a
file (`api_key_file`), never from a setting: settings are written to hparams.yaml, the Hydra folder and the
checkpoints. The start check sends one real request of the run's kind (the model, the score's parameters): a
server that cannot be reached, refuses the key, does not serve the model or returns no log-probs stops the run
before any work, in one line naming the URL.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import re
import string
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from lit_rlvr.config.errors import HTTPRefusal, RewardOptionError
from lit_rlvr.config.extras import installed, message, require
from lit_rlvr.config.problems import unknown_key_problems
from lit_rlvr.rewards.base import DEFAULT_TIMEOUT_S, RewardResult
from lit_rlvr.rewards.checks import is_int, is_number, problem_line
from lit_rlvr.rewards.options import RUNNER_KEYS
from lit_rlvr.run.http import DEFAULT_MAX_RESPONSE_BYTES, async_client, api_key, redact, start_problem, url_problem

YES_NO_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {answer}\n\nResponse:\n{completion}\n\n"
                   "Is the response correct? Answer yes or no.")
PARSED_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {answer}\n\nResponse:\n{completion}\n\n"
                   "Rate the response from 0 to 10. End with 'Score: N'.")
FIELDS = ("prompt", "completion", "answer")
SCORES = ("yes_prob", "parsed")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_SOCKET_S = 600.0  # one socket operation; the runner's timeout_s bounds the whole call (and cancels it)
KEY_HELP = ("set the environment variable OPENAI_API_KEY (or name another: reward.options.api_key_env=NAME), or "
            "put the key in a file: reward.options.api_key_file=PATH")


def template_problem(template: Any, key: str = "reward.options.template") -> Optional[str]:
    if not isinstance(template, str):
        return problem_line(key, template, "a string with {prompt}, {completion} and/or {answer}")
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        return problem_line(key, template, f"a format string ({err}; write {{{{ and }}}} for literal braces)")
    unknown = sorted(names - set(FIELDS))
    if unknown or "completion" not in names:
        return problem_line(key, template, "a string with {completion} (and {prompt}, {answer}); no other fields"
                                           + (f" (found {{{unknown[0]}}})" if unknown else ""))
    try:  # a conversion or format spec that str.format refuses ({completion!z}, {completion:%%})
        template.format(**{name: "" for name in FIELDS})
    except (ValueError, KeyError, IndexError) as err:
        return problem_line(key, template, f"a format string that fills ({err})")
    return None


class JudgeReward:
    """See the module docstring."""

    def __init__(self, base_url: str, model: str, template: Optional[str] = None, score: str = "yes_prob",
                 max_score: float = 10.0, max_tokens: int = 256, top_logprobs: int = 20,
                 api_key_env: Optional[str] = "OPENAI_API_KEY", api_key_file: Optional[str] = None,
                 retries: int = 2, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
        problems = [p for p in [url_problem(base_url, "reward.options.base_url", "http://127.0.0.1:8000/v1")] if p]
        if not isinstance(model, str) or not model:
            problems.append(problem_line("reward.options.model", model, "the judge's model name on the server"))
        if score not in SCORES:
            problems.append(problem_line("reward.options.score", score, " or ".join(SCORES)))
        template = template if template is not None else (PARSED_TEMPLATE if score == "parsed" else YES_NO_TEMPLATE)
        problems += [p for p in [template_problem(template)] if p]
        for key, value, ok, expected in (
                ("max_score", max_score, is_number(max_score) and max_score > 0, "a number > 0"),
                ("max_tokens", max_tokens, is_int(max_tokens, 1), "an integer >= 1"),
                ("top_logprobs", top_logprobs, is_int(top_logprobs, 1) and top_logprobs <= 20, "an integer in [1, 20]"),
                ("retries", retries, is_int(retries, 0), "an integer >= 0"),
                ("max_response_bytes", max_response_bytes, is_int(max_response_bytes, 1),
                 "an integer >= 1 (bytes of one answer)"),
                ("api_key_env", api_key_env, api_key_env is None or isinstance(api_key_env, str) and api_key_env,
                 "the name of the environment variable that holds the API key"),
                ("api_key_file", api_key_file, api_key_file is None or isinstance(api_key_file, str)
                 and os.access(os.path.expanduser(api_key_file), os.R_OK), "a readable file that holds the API key")):
            if not ok:
                problems.append(problem_line(f"reward.options.{key}", value, expected))
        if problems:
            raise RewardOptionError(problems)
        self.base_url, self.model, self.template, self.score = base_url, model, template, score
        self.max_score, self.max_tokens, self.top_logprobs = float(max_score), max_tokens, top_logprobs
        self.api_key_env, self.api_key_file, self.retries = api_key_env, api_key_file, retries
        self.max_response_bytes = max_response_bytes
        self._client: Optional[Any] = None

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> list[str]:
        """Before any work: the settings, then one real request of the run's kind (`probe`)."""
        runner_keys = RUNNER_KEYS  # the runner's (`RunnerOptions`), checked there
        own = list(inspect.signature(cls).parameters)
        if "api_key" in options:  # its value is never repeated: this line goes to the terminal and the logs
            return ["reward.options.api_key is not an option: a key in the settings would be written to "
                    f"hparams.yaml, the Hydra folder and the checkpoints; {KEY_HELP}"]
        problems = unknown_key_problems("reward.options", list(options), [*own, *runner_keys])
        for k in ("base_url", "model"):
            if k not in options or options[k] is None:
                problems.append(f"reward=judge needs reward.options.{k}")
            elif options[k] == "???":  # Hydra's unset value
                problems.append(problem_line(f"reward.options.{k}", "???", f"a value: set reward.options.{k}=..."))
        if problems:
            return problems
        if not installed("openai"):
            return [f"reward=judge: {message('openai')}"]
        try:
            judge = cls(**{k: v for k, v in options.items() if k not in runner_keys})
        except RewardOptionError as err:
            return list(err.problems)
        except TypeError as err:
            return [f"reward=judge: {err}"]
        timeout_s = options.get("timeout_s", DEFAULT_TIMEOUT_S)
        return [p for p in [judge.probe(timeout_s if is_number(timeout_s) and timeout_s > 0 else DEFAULT_TIMEOUT_S)]
                if p]

    def probe(self, timeout_s: float) -> Optional[str]:
        """The start check: one request as the run makes them (this model, this score's parameters), within
        `timeout_s`; None when it is answered as the run needs, else the line why not."""
        async def ask() -> Any:
            try:
                return await asyncio.wait_for(self._ask("What is 1+1?", "2", "2"), timeout_s)
            finally:
                client, self._client = self._client, None
                if client is not None:
                    await client.close()

        key = "reward.options.base_url"
        with ThreadPoolExecutor(1) as pool:  # its own event loop, whatever the caller's thread runs
            try:
                response = pool.submit(asyncio.run, ask()).result()
            except asyncio.TimeoutError:
                return f"{key}={redact(self.base_url)!r}: the start check's request had no answer in {timeout_s:g}s"
            except HTTPRefusal as err:
                if err.status in (401, 403):
                    return f"{key}={redact(self.base_url)!r}: the server refuses the API key ({err}); {KEY_HELP}"
                if err.status == 404:
                    return (f"{key}={redact(self.base_url)!r}: {err}: does it serve reward.options.model="
                            f"{self.model!r} at {redact(self.base_url)}/chat/completions?")
                return start_problem(key, self.base_url, err)
            except Exception as err:
                return start_problem(key, self.base_url, err)
        if self.score == "yes_prob" and not (response.choices and response.choices[0].logprobs):
            return (f"{key}={redact(self.base_url)!r}: the judge's answer has no log-probs, which score=yes_prob "
                    "reads (a server without logprobs: reward.options.score=parsed)")
        return None

    def _chat(self) -> Any:
        if self._client is None:  # made on the event loop that awaits it
            openai = require("openai")
            self._client = openai.AsyncOpenAI(base_url=self.base_url, max_retries=self.retries, timeout=_SOCKET_S,
                                              api_key=api_key(self.api_key_env, self.api_key_file),
                                              http_client=async_client(_SOCKET_S, self.max_response_bytes,
                                                                       "reward.options.max_response_bytes"))
        return self._client.chat.completions

    async def _ask(self, prompt: Any, completion: str, answer: Any) -> Any:
        """The judge's answer to one completion (the API's response object), or an `HTTPRefusal` in one line."""
        if isinstance(prompt, list):
            prompt = "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
        content = self.template.format(prompt=prompt, completion=completion, answer=answer)
        params = (dict(max_tokens=1, logprobs=True, top_logprobs=self.top_logprobs) if self.score == "yes_prob"
                  else dict(max_tokens=self.max_tokens))
        try:
            return await self._chat().create(model=self.model, messages=[{"role": "user", "content": content}],
                                             temperature=0.0, **params)
        except Exception as err:
            raise api_refusal(err, self.base_url) from None

    async def __call__(self, prompt: Any, completion: str, answer: Any) -> RewardResult:
        response = await self._ask(prompt, completion, answer)
        if self.score == "yes_prob":
            return yes_probability(response)
        return parsed_score(response.choices[0].message.content or "", self.max_score)


def api_refusal(err: Exception, url: str) -> Exception:
    """The openai client's error as one line naming the URL (credentials redacted); what the client's transport
    refused (lit_rlvr/run/http.py) as it is (an older client wraps it in APIConnectionError)."""
    for found in (err, err.__cause__):
        if isinstance(found, HTTPRefusal):
            return found
    openai = require("openai")
    if isinstance(err, openai.APIStatusError):
        why = " (the server refuses the API key)" if err.status_code in (401, 403) else ""
        return HTTPRefusal(f"{redact(url)} answered HTTP {err.status_code}{why}: {redact(err.message)[:300]}",
                           "status", err.status_code)
    if isinstance(err, openai.APITimeoutError):
        return HTTPRefusal(f"{redact(url)}: timed out", "deadline")
    if isinstance(err, openai.APIConnectionError):
        cause = err.__cause__ or err
        detail = f"{type(cause).__name__}: {redact(cause)}"[:300]
        if "ssl" in detail.lower():
            return HTTPRefusal(f"{redact(url)}: the TLS handshake failed (an https:// URL for a plain http "
                               f"server?): {detail}", "tls")
        return HTTPRefusal(f"{redact(url)}: {detail}", "connection")
    return err


def yes_probability(response: Any) -> RewardResult:
    """P(yes) / (P(yes) + P(no)) from the first generated token's top log-probs (a token counts for a word it
    begins: "Yes", " yes", "y")."""
    content = response.choices[0].logprobs.content if response.choices[0].logprobs else None
    if not content:
        return RewardResult(0.0, True, "the judge returned no log-probs (does the server support logprobs?)")
    yes = no = 0.0
    for candidate in content[0].top_logprobs:
        word = candidate.token.strip().lower()
        if word and "yes".startswith(word):
            yes += math.exp(candidate.logprob)
        elif word and "no".startswith(word):
            no += math.exp(candidate.logprob)
    if yes + no == 0.0:
        return RewardResult(0.0, True, "neither yes nor no among the judge's top tokens")
    return RewardResult(yes / (yes + no), False)


def parsed_score(text: str, max_score: float) -> RewardResult:
    numbers = _NUMBER.findall(text)
    if not numbers:
        return RewardResult(0.0, True, f"no number in the judge's answer: {text[:200]!r}")
    return RewardResult(min(max(float(numbers[-1]) / max_score, 0.0), 1.0), False)
