"""The built-in `arithmetic` task: procedural integer problems at several difficulty levels.

A prompt is the problem followed by "=" (e.g. "47+85="); the answer is the integer. Train and test problems
never overlap: a problem belongs to the test split when a seeded hash of its text falls below
`test_fraction`, so the split is fixed by the seed alone, whatever the number of problems drawn.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

from lit_rlvr.rewards.base import RewardResult

# level -> (operator, operand ranges, condition); "carry" levels force a carry in the units digit.
LEVELS: dict[int, str] = {
    1: "one-digit addition",
    2: "two-digit addition, no carry",
    3: "two-digit addition with a carry",
    4: "two-digit subtraction, non-negative result",
    5: "one-digit multiplication",
    6: "two-digit by one-digit multiplication",
}


def _draw(level: int, rng: random.Random) -> tuple[str, int]:
    if level == 1:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a}+{b}", a + b
    if level in (2, 3):
        while True:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if ((a % 10 + b % 10) >= 10) == (level == 3):
                return f"{a}+{b}", a + b
    if level == 4:
        a, b = sorted((rng.randint(10, 99), rng.randint(0, 99)), reverse=True)
        return f"{a}-{b}", a - b
    if level == 5:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a}*{b}", a * b
    if level == 6:
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        return f"{a}*{b}", a * b
    raise ValueError(f"data.levels: unknown level {level}; valid: {sorted(LEVELS)}")


@dataclass(frozen=True)
class ArithmeticTask:
    """Problems of the chosen `levels`; a problem is a pure function of (seed, split, index). A task with other
    problems subclasses it: its own `valid_levels`, `key_prefix` (its problems' seeds) and `_draw`/`_record`."""

    levels: tuple[int, ...] = (2, 3, 4)  # the default run's (conf/data/arithmetic.yaml), so Python gets it too
    seed: int = 0
    test_fraction: float = 0.1
    valid_levels: ClassVar[dict] = LEVELS
    key_prefix: ClassVar[str] = ""
    name_hint: ClassVar[str] = ""  # names the task in the level error

    def __post_init__(self) -> None:
        bad = [lv for lv in self.levels if lv not in self.valid_levels]
        if not self.levels or bad:
            raise ValueError(f"data.levels={list(self.levels)} is not valid{self.name_hint}; choose from "
                             f"{sorted(self.valid_levels)}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"data.test_fraction must be in (0, 1), got {self.test_fraction}")

    def split_of(self, problem: str) -> str:
        bucket = zlib.crc32(f"{self.key_prefix}{self.seed}:{problem}".encode()) % 10_000
        return "test" if bucket < self.test_fraction * 10_000 else "train"

    def problem(self, index: int, split: str = "train") -> dict[str, Any]:
        """Problem `index` of `split`, a pure function of (seed, split, index)."""
        rng = random.Random(f"{self.key_prefix}{self.seed}:{split}:{index}")
        while True:
            level = rng.choice(self.levels)
            text, answer = self._draw(level, rng)
            if self.split_of(text) == split:
                return self._record(text, answer, level)

    def _draw(self, level: int, rng: random.Random) -> tuple[str, Any]:
        return _draw(level, rng)

    def _record(self, text: str, answer: Any, level: int) -> dict[str, Any]:
        return {"prompt": f"{text}=", "answer": answer, "level": level}

    def problems(self, count: int, split: str = "train") -> list[dict[str, Any]]:
        return [self.problem(i, split) for i in range(count)]


_LEADING_INT = re.compile(r"\s*(-?\d+)")


def arithmetic_reward(prompt: str, completion: str, answer: Any) -> RewardResult:
    """+1 when the completion starts with the right integer, −1 otherwise; malformed when it starts with none."""
    match = _LEADING_INT.match(completion)
    if match is None:
        return RewardResult(-1.0, True)
    return RewardResult(1.0 if int(match.group(1)) == int(answer) else -1.0, False)
