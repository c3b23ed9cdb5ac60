"""`RunnerOptions`: how a reward is called, apart from what the reward itself is configured with.

`reward.options` holds both: the runner's keys (`RUNNER_KEYS`) and the reward's own (a class's constructor
arguments). `RunnerOptions.split` takes the runner's keys out and checks them where they are defined, one line per
bad value naming the key, the value and what is allowed; the rest go to the reward. A runner key that a reward class
also takes as an argument of its own (`PASSED_ON`) is given to it too (the code sandbox's `timeout_s` and `workers`,
a reward server's `max_concurrent`). Torch-free: reward worker processes import this package.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.problems import problem_line

ISOLATIONS = ("none", "process")
DEFAULT_TIMEOUT_S = 5.0  # reward.options.timeout_s: seconds one call may take, in every isolation mode
DEFAULT_SCORE_BOUND = 1e6  # reward.options.score_bound: |score| above it is malformed
DEFAULT_WORKERS = 2  # reward.options.workers: worker processes under isolation=process
DEFAULT_MAX_CONCURRENT = 64  # reward.options.max_concurrent: an async reward's calls in flight at once
# runner keys that a reward class taking an argument of the same name also receives (the rest are the runner's
# alone); under isolation=process the worker pool owns timeout_s and workers
PASSED_ON = ("timeout_s", "workers", "max_concurrent")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# key -> (is the value valid?, what is allowed)
_RULES = {
    "isolation": (lambda v: v in ISOLATIONS, "one of none, process"),
    "timeout_s": (lambda v: _number(v) and v > 0, "a number of seconds > 0"),
    "score_bound": (lambda v: _number(v) and v > 0, "a number > 0 (|score| above it is malformed)"),
    "workers": (lambda v: _integer(v) and v >= 1, "an integer >= 1 (worker processes)"),
    "max_concurrent": (lambda v: v is None or (_integer(v) and v >= 1), "an integer >= 1 (calls in flight)"),
}


def _as_number(value: Any) -> Any:
    """"5" or "1e-3" from a command line as the number it spells; anything else unchanged (then checked)."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    return value


@dataclass(frozen=True)
class RunnerOptions:
    """The runner's settings (docs/rewards.md, "The runner: time bounds, isolation, stops").

    isolation: `none` (calls in the training process, on a watchdog thread) or `process` (worker processes).
    timeout_s: every call's bound, in every isolation mode (a batch reward bounds its own calls).
    score_bound: |score| above it is malformed.
    workers: worker processes under isolation=process.
    max_concurrent: an async reward's calls in flight (None: 64); a reward class that takes it uses it its way.
    key: where the settings live, for the error lines (a term's are under reward.options.terms.NAME.options).
    """

    isolation: str = "none"
    timeout_s: float = DEFAULT_TIMEOUT_S
    score_bound: float = DEFAULT_SCORE_BOUND
    workers: int = DEFAULT_WORKERS
    max_concurrent: Optional[int] = None
    key: str = dataclasses.field(default="reward.options", compare=False)

    def __post_init__(self) -> None:
        for name in _RULES:
            object.__setattr__(self, name, _as_number(getattr(self, name)))
        ConfigError.check(self.problems({name: getattr(self, name) for name in _RULES}, self.key))
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        object.__setattr__(self, "score_bound", float(self.score_bound))

    @staticmethod
    def problems(options: Mapping[str, Any], key: str = "reward.options") -> list[str]:
        """One line per runner key of `options` whose value is not allowed (other keys are not looked at)."""
        lines = []
        for name, (ok, allowed) in _RULES.items():
            if name in options and not ok(_as_number(options[name])):
                lines.append(problem_line(f"{key}.{name}", options[name], allowed))
        return lines

    @classmethod
    def split(cls, options: Mapping[str, Any], key: str = "reward.options") -> tuple["RunnerOptions", dict[str, Any]]:
        """(the runner's settings, the reward's own options) from one `reward.options` mapping."""
        runner = {k: v for k, v in options.items() if k in _RULES}
        return cls(**runner, key=key), {k: v for k, v in options.items() if k not in _RULES}

    @property
    def cap(self) -> int:
        """An async reward's calls in flight."""
        return DEFAULT_MAX_CONCURRENT if self.max_concurrent is None else self.max_concurrent

    def replace(self, **changes: Any) -> "RunnerOptions":
        return dataclasses.replace(self, **changes)


RUNNER_KEYS = tuple(_RULES)
