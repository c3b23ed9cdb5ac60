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
client's `retries`) makes that completion malformed and counted. The endpoint is checked at start (a connection
to `base_url`'s host and port): unreachable stops the run before any work, in one line naming the URL.
"""

from __future__ import annotations

import inspect
import math
import re
import string
from typing import Any, Optional

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.config.extras import installed, message, require
from lit_rlvr.config.problems import unknown_key_problems
from lit_rlvr.rewards.base import RewardResult
from lit_rlvr.rewards.checks import is_int, is_number, problem_line
from lit_rlvr.rewards.remote import url_problem

YES_NO_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {answer}\n\nResponse:\n{completion}\n\n"
                   "Is the response correct? Answer yes or no.")
PARSED_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {answer}\n\nResponse:\n{completion}\n\n"
                   "Rate the response from 0 to 10. End with 'Score: N'.")
FIELDS = ("prompt", "completion", "answer")
SCORES = ("yes_prob", "parsed")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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
                 max_score: float = 10.0, max_tokens: int = 256, top_logprobs: int = 20, api_key: str = "EMPTY",
                 retries: int = 2, probe: bool = True):
        problems = [p for p in [url_problem(base_url, "reward.options.base_url", probe)] if p]
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
                ("retries", retries, is_int(retries, 0), "an integer >= 0")):
            if not ok:
                problems.append(problem_line(f"reward.options.{key}", value, expected))
        if problems:
            raise RewardOptionError(problems)
        self.base_url, self.model, self.template, self.score = base_url, model, template, score
        self.max_score, self.max_tokens, self.top_logprobs = float(max_score), max_tokens, top_logprobs
        self.api_key, self.retries = api_key, retries
        self._client: Optional[Any] = None

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> list[str]:
        runner_keys = ("timeout_s", "max_concurrent", "isolation", "score_bound")
        own = [p for p in inspect.signature(cls).parameters if p != "probe"]
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
            cls(**{k: v for k, v in options.items() if k not in runner_keys})
        except RewardOptionError as err:
            return list(err.problems)
        except TypeError as err:
            return [f"reward=judge: {err}"]
        return []

    def _chat(self) -> Any:
        if self._client is None:  # made on the event loop that awaits it
            openai = require("openai")
            self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=self.retries)
        return self._client.chat.completions

    async def __call__(self, prompt: Any, completion: str, answer: Any) -> RewardResult:
        if isinstance(prompt, list):
            prompt = "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
        content = self.template.format(prompt=prompt, completion=completion, answer=answer)
        messages = [{"role": "user", "content": content}]
        if self.score == "yes_prob":
            response = await self._chat().create(model=self.model, messages=messages, max_tokens=1, temperature=0.0,
                                                 logprobs=True, top_logprobs=self.top_logprobs)
            return yes_probability(response)
        response = await self._chat().create(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                             temperature=0.0)
        return parsed_score(response.choices[0].message.content or "", self.max_score)


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
