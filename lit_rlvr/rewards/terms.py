"""Weighted reward terms (`reward=terms`): several rewards, each with its own options and runner, summed with
weights into one score per completion; and two small built-in terms, `format` and `length`.

The rule for one completion, written once here (docs/rewards.md says the same):

- each term is scored by its own runner (`build_reward_runner`: its own isolation, time bound and value rule);
- a term that returns None does not score that completion (TRL's rule for multi-task data): it is left out of the
  sum; a completion that no term scores is malformed, scored `failure_score` and counted;
- a term that fails on a completion (raises, times out, returns a value that breaks the contract) makes the
  completion malformed, scored `failure_score` and counted once in `reward_failures` (a partial sum would pay the
  other terms for a completion the failed term never judged), and once in that term's `reward/<name>/failures`;
- otherwise the score is Σ weight × score over the terms that scored it, malformed when any of them says
  malformed; the sum is held to the same value rule (finite, within `score_bound`).

Logged per term each step: `reward/<name>/mean` (over the completions it scored), `reward/<name>/failures`.
Terms run one after another, each over the whole batch (an async or remote term overlaps its own calls).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.rewards.base import RewardBatch, RewardResult, Runner
from lit_rlvr.rewards.checks import constructor_problems, is_number as _is_number, problem_line
from lit_rlvr.rewards.options import DEFAULT_SCORE_BOUND, RunnerOptions

TERM_KEYS = ("reward", "weight", "options")
# runner options given at the top of reward.options apply to every term that does not set its own
SHARED_KEYS = ("isolation", "timeout_s", "workers", "max_concurrent")


@dataclass
class Term:
    name: str
    weight: float
    runner: Any  # a reward runner: (prompts, completions, answers) -> RewardBatch


def term_specs(value: Any, key: str = "reward.options.terms") -> tuple[list[tuple[str, Any, Any, dict]], list[str]]:
    """[(name, reward, weight, options)] from a mapping {name: {reward, weight, options}} (or {name: weight}) or a
    list of such entries with a `name` (or bare names); and one problem line per bad entry."""
    if isinstance(value, dict):
        entries = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        entries = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                entries.append((item, {}))
            elif isinstance(item, dict) and isinstance(item.get("name"), str):
                entries.append((item["name"], {k: v for k, v in item.items() if k != "name"}))
            else:
                return [], [problem_line(f"{key}[{i}]", item, "a reward name or a mapping with a name")]
    else:
        return [], [problem_line(key, value, "a mapping {name: {reward, weight, options}} or a list of them")]
    if not entries:
        return [], [problem_line(key, value, "at least one term")]
    specs, problems, seen = [], [], set()
    for name, spec in entries:
        where = f"{key}.{name}"
        if name in seen:
            problems.append(f"{where}: two terms named {name!r}; give each its own name (and reward: the reward)")
            continue
        seen.add(name)
        if spec is None or _is_number(spec):
            spec = {} if spec is None else {"weight": spec}
        if not isinstance(spec, dict):
            problems.append(problem_line(where, spec, "a mapping with reward, weight, options (or the weight)"))
            continue
        unknown = sorted(set(spec) - set(TERM_KEYS))
        if unknown:
            problems.append(f"{where}.{unknown[0]} is not a term key; valid: {', '.join(TERM_KEYS)}")
            continue
        weight, options = spec.get("weight", 1.0), spec.get("options") or {}
        if not (_is_number(weight) and math.isfinite(weight)):
            problems.append(problem_line(f"{where}.weight", weight, "a finite number"))
        if not isinstance(options, dict):
            problems.append(problem_line(f"{where}.options", options, "a mapping of the term's reward options"))
            continue
        reward = spec.get("reward") or name
        if reward == "terms":
            problems.append(problem_line(f"{where}.reward", reward, "a reward other than terms (terms do not nest)"))
            continue
        specs.append((name, reward, weight, dict(options)))
    return specs, problems


def build_terms(options: dict[str, Any], build: Any, takes_cap: Any = lambda reward: True) -> "TermsRunner":
    """The `TermsRunner` of `reward=terms` with `options` (`terms`, `score_bound` and the shared runner keys);
    `build(name, options)` builds one term's runner (`lit_rlvr.rewards.build_reward_runner`); a shared
    `max_concurrent` goes only to the terms for which `takes_cap(reward)` (async, or a class that takes it)."""
    options = dict(options)
    specs, problems = term_specs(options.pop("terms", None))
    score_bound = options.pop("score_bound", DEFAULT_SCORE_BOUND)
    shared = {k: options.pop(k) for k in SHARED_KEYS if k in options}
    if options:
        problems.append(f"reward.options.{sorted(options)[0]} is not an option of reward=terms; valid: terms, "
                        f"score_bound, {', '.join(SHARED_KEYS)} (a term's own options go in its options)")
    problems += RunnerOptions.problems({**shared, "score_bound": score_bound})
    if problems:
        raise RewardOptionError(problems)
    terms = []
    try:
        for name, reward, weight, own in specs:
            common = {k: v for k, v in shared.items() if k != "max_concurrent" or takes_cap(reward)}
            runner = build(reward, {**common, **own})
            runner.contract.none_skips = True  # None: this term does not score that completion
            terms.append(Term(name, float(weight), runner))
    except BaseException:
        for term in terms:
            term.runner.close()
        raise
    return TermsRunner(terms, RunnerOptions(score_bound=score_bound))


class TermsRunner(Runner):
    """Scores a batch with every term and sums them by the rule in the module docstring."""

    def __init__(self, terms: Sequence[Term], options: Optional[RunnerOptions] = None, **settings: Any):
        super().__init__(None, options, **settings)
        self.terms = list(terms)
        self._sums: dict[str, list[float]] = {}  # name -> [score sum, scored, failures] since the last take

    @property
    def stop_reason(self) -> Optional[str]:
        return next((t.runner.stop_reason for t in self.terms if t.runner.stop_reason), None)

    def _score(self, jobs: list[tuple]) -> list[Any]:
        prompts, completions, answers = (list(column) for column in zip(*jobs))
        batches = [t.runner(prompts, completions, answers) for t in self.terms]
        values: list[Any] = []
        for i in range(len(completions)):
            failed = [t.name for t, b in zip(self.terms, batches) if b.failed[i]]
            scored = [(t, b) for t, b in zip(self.terms, batches) if not (b.failed[i] or b.skipped[i])]
            if failed:
                values.append(self.contract.failed(f"term {', '.join(failed)} failed"))
            elif not scored:  # the sum's own contract: something must have scored it
                values.append(self.contract._violation("no term scored it", "every term returned None"))
            else:
                total = sum(t.weight * float(b.scores[i]) for t, b in scored)
                values.append(RewardResult(total, any(bool(b.malformed[i]) for _, b in scored)))
        self._tally(batches)
        return values

    def _tally(self, batches: list[RewardBatch]) -> None:
        for term, batch in zip(self.terms, batches):
            kept = ~(batch.failed | batch.skipped)
            sums = self._sums.setdefault(term.name, [0.0, 0, 0])
            sums[0] += float(batch.scores[kept].sum())
            sums[1] += int(kept.sum())
            sums[2] += int(batch.failed.sum())

    def take_metrics(self) -> dict[str, float]:
        """`reward/<name>/mean` and `reward/<name>/failures` since the last take (the driver takes them per step)."""
        metrics = {}
        for name, (total, scored, failures) in self._sums.items():
            if scored:
                metrics[f"reward/{name}/mean"] = total / scored
            metrics[f"reward/{name}/failures"] = float(failures)
        self._sums = {}
        return metrics

    def close(self) -> None:
        for term in self.terms:
            term.runner.close()


class FormatReward:
    """`format`: 1.0 when the completion has the expected form, else 0.0 (never malformed: that is the answer
    reward's call). By default the form is exactly one `\\boxed{...}`; `pattern` is any regular expression,
    required `count` times (null: at least once), or matching the whole stripped completion with `fullmatch`."""

    def __init__(self, pattern: str = r"\\boxed\{[^{}]*\}", count: Optional[int] = 1, fullmatch: bool = False):
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except (re.error, TypeError) as err:
            raise RewardOptionError([problem_line("reward.options.pattern", pattern, f"a regular expression ({err})")])
        if count is not None and not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            raise RewardOptionError([problem_line("reward.options.count", count,
                                                  "an integer >= 0 or null (at least one)")])
        self.count, self.fullmatch = count, bool(fullmatch)

    check_options = classmethod(constructor_problems)

    def __call__(self, prompt: Any, completion: str, answer: Any) -> float:
        if self.fullmatch:
            return float(self.regex.fullmatch(completion.strip()) is not None)
        found = len(self.regex.findall(completion))
        return float(found == self.count if self.count is not None else found > 0)


class LengthReward:
    """`length`: DAPO's soft overlong punishment, on the completion's text: 0 up to `max_len - cache`, falling
    linearly to -1 at `max_len`, -1 beyond. Lengths are counted in `unit`: chars or words (whitespace-split; the
    reward sees text, not tokens: DAPO's own token-based term is algorithm=dapo's overlong_*)."""

    def __init__(self, max_len: int = 1024, cache: int = 256, unit: str = "chars"):
        problems = []
        if not (isinstance(max_len, int) and not isinstance(max_len, bool) and max_len >= 1):
            problems.append(problem_line("reward.options.max_len", max_len, "an integer >= 1"))
        elif not (isinstance(cache, int) and not isinstance(cache, bool) and 0 <= cache <= max_len):
            problems.append(problem_line("reward.options.cache", cache, f"an integer in [0, max_len={max_len}]"))
        if unit not in ("chars", "words"):
            problems.append(problem_line("reward.options.unit", unit, "chars or words"))
        if problems:
            raise RewardOptionError(problems)
        self.max_len, self.cache, self.unit = max_len, cache, unit

    check_options = classmethod(constructor_problems)

    def __call__(self, prompt: Any, completion: str, answer: Any) -> float:
        length = len(completion) if self.unit == "chars" else len(completion.split())
        if length <= self.max_len - self.cache:
            return 0.0
        if length >= self.max_len:
            return -1.0
        return -(length - (self.max_len - self.cache)) / self.cache
