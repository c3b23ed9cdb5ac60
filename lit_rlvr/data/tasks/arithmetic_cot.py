"""The built-in `arithmetic_cot` task: multi-digit arithmetic whose completion writes its working.

A prompt is the problem and "=" (e.g. "347+589="). The reference completion works it out on paper, one line
per step, and ends with the marked final answer the reward reads:

    addition, one line per column from the right: digit + digit + carry = column sum
        347+589=  ->  "7+9+0=16\\n4+8+1=13\\n3+5+1=9\\nAnswer: 936"
    subtraction (a >= b), one line per column: the top digit (plus 10 when it borrows) - digit - borrow = digit
        52-17=    ->  "12-7-0=5\\n5-1-1=3\\nAnswer: 35"
    multiplication, one line per digit of the multiplier (its columns: digit * m + carry = product), then the
    shifted partial products are added by the addition's columns
        47*36=    ->  "47*6: 7*6+0=42 4*6+4=28 -> 282\\n47*3: 7*3+0=21 4*3+2=14 -> 141\\n"
                      "282+1410:\\n2+0+0=2\\n8+1+0=9\\n2+4+0=6\\n0+1+0=1\\n-> 1692\\nAnswer: 1692"

Levels go from ~30 completion tokens (two-digit addition) to ~200 (four-digit by two-digit multiplication)
with the built-in model's character tokenizer. Train and test problems never overlap (a seeded hash of the
problem text, as in `arithmetic`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from lit_rlvr.data.tasks.arithmetic import ArithmeticTask
from lit_rlvr.rewards.base import RewardResult

# level -> (operator, digits of the first operand, digits of the second operand)
LEVELS: dict[int, tuple[str, int, int]] = {
    1: ("+", 2, 2),
    2: ("+", 3, 3),
    3: ("+", 4, 4),
    4: ("-", 3, 3),
    5: ("-", 4, 4),
    6: ("*", 2, 1),
    7: ("*", 2, 2),
    8: ("*", 3, 2),
    9: ("*", 4, 2),
}
ANSWER_MARK = "Answer: "


def _digits(n: int, width: int) -> list[int]:
    """The `width` lowest digits of n, units first."""
    return [(n // 10**i) % 10 for i in range(width)]


def add_working(a: int, b: int) -> tuple[list[str], int]:
    """Column lines "x+y+c=s" (units first) and the sum."""
    width = max(len(str(a)), len(str(b)))
    lines, carry = [], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        s = x + y + carry
        lines.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return lines, a + b


def sub_working(a: int, b: int) -> tuple[list[str], int]:
    """Column lines "X-y-c=d" (units first; X is the top digit plus 10 where it borrows) and a - b (a >= b)."""
    width = len(str(a))
    lines, borrow = [], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        take = 1 if x - y - borrow < 0 else 0
        lines.append(f"{x + 10 * take}-{y}-{borrow}={x + 10 * take - y - borrow}")
        borrow = take
    return lines, a - b


def mul_working(a: int, b: int) -> tuple[list[str], int]:
    """One line per digit of b (units first): "a*m: x*m+c=p ... -> a·m", then the shifted partial products
    added one after another with `add_working`; returns the lines and a·b."""
    lines, partials = [], []
    for shift, m in enumerate(_digits(b, len(str(b)))):
        columns, carry = [], 0
        for x in _digits(a, len(str(a))):
            p = x * m + carry
            columns.append(f"{x}*{m}+{carry}={p}")
            carry = p // 10
        lines.append(f"{a}*{m}: {' '.join(columns)} -> {a * m}")
        partials.append(a * m * 10**shift)
    total = partials[0]
    for partial in partials[1:]:
        column_lines, new_total = add_working(total, partial)
        lines += [f"{total}+{partial}:", *column_lines, f"-> {new_total}"]
        total = new_total
    return lines, total


WORKINGS = {"+": add_working, "-": sub_working, "*": mul_working}


def reference_completion(problem: str) -> str:
    """The written working of "a<op>b" and its marked answer (no end-of-sequence token)."""
    a, op, b = parse_problem(problem)
    lines, answer = WORKINGS[op](a, b)
    return "\n".join([*lines, f"{ANSWER_MARK}{answer}"])


_PROBLEM = re.compile(r"^(\d+)([+\-*])(\d+)=?$")


def parse_problem(problem: str) -> tuple[int, str, int]:
    match = _PROBLEM.match(problem.strip())
    if match is None:
        raise ValueError(f"not an arithmetic_cot problem: {problem!r} (expected e.g. '347+589=')")
    return int(match.group(1)), match.group(2), int(match.group(3))


def _operand(digits: int, rng: random.Random) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1) if digits > 1 else rng.randint(2, 9)


def _draw(level: int, rng: random.Random) -> str:
    op, da, db = LEVELS[level]
    a, b = _operand(da, rng), _operand(db, rng)
    if op == "-" and a < b:
        a, b = b, a
    return f"{a}{op}{b}"


@dataclass(frozen=True)
class ArithmeticCoTTask(ArithmeticTask):
    """Problems of the chosen `levels`; each record also holds the reference working (`target`, for SFT)."""

    levels: tuple[int, ...] = (1, 2, 4)
    valid_levels: ClassVar[dict] = LEVELS
    key_prefix: ClassVar[str] = "cot:"
    name_hint: ClassVar[str] = " for data.task=arithmetic_cot"

    def _draw(self, level: int, rng: random.Random) -> tuple[str, Any]:
        return _draw(level, rng), None

    def _record(self, text: str, answer: Any, level: int) -> dict[str, Any]:
        a, op, b = parse_problem(text)
        return {"prompt": f"{text}=", "answer": WORKINGS[op](a, b)[1], "level": level,
                "target": reference_completion(text)}


_FINAL = re.compile(r"Answer: (-?\d+)\s*$")


def read_answer(completion: str) -> int | None:
    """The integer after the one "Answer: " mark, which must end the completion; None when malformed (no mark,
    several marks, no integer, or text after it)."""
    if completion.count(ANSWER_MARK.strip()) != 1:
        return None
    match = _FINAL.search(completion)
    return int(match.group(1)) if match else None


def arithmetic_cot_reward(prompt: str, completion: str, answer: Any) -> RewardResult:
    """+1 when the marked final answer equals `answer`, −1 otherwise; malformed (−1) when none can be read.
    Only the final answer counts: the working is the model's own (`check_working` audits it)."""
    value = read_answer(completion)
    if value is None:
        return RewardResult(-1.0, True)
    return RewardResult(1.0 if value == int(answer) else -1.0, False)


_STEP = re.compile(r"(\d+)([+\-*])(\d+)([+\-])(\d+)=(\d+)")


def check_working(completion: str) -> list[str]:
    """Every written step "x op y op2 c = r" whose arithmetic is wrong, and a missing or unreadable final
    answer; [] when all steps are right (it checks each step's arithmetic, not that the steps follow the
    method)."""
    errors = []
    for match in _STEP.finditer(completion):
        x, op, y, op2, c, r = match.groups()
        value = {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        value = value + int(c) if op2 == "+" else value - int(c)
        if value != int(r):
            errors.append(f"{match.group(0)} (is {value})")
    if read_answer(completion) is None:
        errors.append("no final answer")
    return errors
