"""Math reward: is the completion's final answer equal to the gold answer? Graded with math-verify.

Rules (docs/architecture.md §8), +1 correct, −1 wrong, −1 and malformed when no answer can be read:

* The final answer is the content of the last `\\boxed{...}` (or `\\fbox{...}`); earlier boxes are
  answers the model revised. (math-verify alone would join nearby boxes into a set; we do not: a multi-part
  answer goes in one box, "\\boxed{1, 2}".) A last box that never closes (output cut at the length
  limit) is malformed.
* No box: only the anchored forms math-verify knows ("the final answer is $x$", "Answer: x") count. A bare
  number somewhere in the reasoning never does — grading it would reward whatever the text ended on.
  Nothing found (or an empty box) = malformed.
* The gold answer may be bare ("3/4", "\\frac{3}{4}", 0.75), in `$...$`, or contain a `\\boxed{}`.
* A percent sign is kept as math-verify's percent value, so "50\\%" matches both 50 and 0.5.

Hangs: sympy can take forever on some expressions (`9^{9^{9^{9^{9}}}}`). math-verify's own timeouts use
`signal.alarm`, so they are switched on only in a main thread (e.g. inside a `ProcessRewardRunner` worker)
and turn a slow parse or comparison into malformed; expressions that block inside C code are stopped only
by the process runner's hard timeout. Run this reward through `ProcessRewardRunner` during training.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from lit_rlvr.config.options import convert
from lit_rlvr.rewards.base import RewardResult

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PCT_RE = re.compile(r"\s*\\?%\s*$")
# For text already reduced to one answer (a box's content, a gold answer) wrapped in $...$.
_ANSWER_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
# For completions without a box: only anchored answers ("final answer is", "answer:").
_ANCHORED_CONFIG = (
    LatexExtractionConfig(try_extract_without_anchor=False),
    ExprExtractionConfig(try_extract_without_anchor=False),
)


class MathReward:
    """Callable math reward, `fn(prompt, completion, answer) -> RewardResult` (picklable for worker pools).

    Args:
        format_weight: optional format term added to the score: `+format_weight` when the completion has
            exactly one box, `−format_weight` otherwise. 0 (default) keeps rewards in {−1, +1}, which V0.5's
            fusion assumes.
        timeout_s: math-verify's own per-parse / per-comparison limit in whole seconds (it uses
            `signal.alarm`, so only in a main thread); 0 disables it. A timeout there scores malformed.
        float_rounding: decimal places math-verify rounds floats to before comparing.
    """

    def __init__(self, format_weight: float = 0.0, timeout_s: int = 3, float_rounding: int = 6):
        timeout_s = convert("reward.options.timeout_s", timeout_s, float)
        if timeout_s < 0:
            raise ValueError(f"reward.options.timeout_s must be >= 0 (0 = off), got {timeout_s}")
        self.format_weight = convert("reward.options.format_weight", format_weight, float)
        self.timeout_s = int(math.ceil(timeout_s))  # signal.alarm takes whole seconds
        self.float_rounding = convert("reward.options.float_rounding", float_rounding, int)

    def __call__(self, prompt: str, completion: str, answer: Any) -> RewardResult:
        timeout = self.timeout_s if threading.current_thread() is threading.main_thread() else 0
        pred = parse_prediction(completion, timeout_s=timeout)
        bonus = self._format_term(completion)
        if not pred:
            return RewardResult(-1.0 + bonus, True, "no answer found")
        gold = parse_gold(answer, timeout_s=timeout)
        if not gold:
            return RewardResult(-1.0 + bonus, False, f"gold answer unreadable: {str(answer)[:80]!r}")
        verdict = _equivalent(gold, pred, timeout, self.float_rounding)
        shown = _shown(pred)
        if verdict is None:
            return RewardResult(-1.0 + bonus, True, f"timeout comparing pred={shown}")
        return RewardResult((1.0 if verdict else -1.0) + bonus, False,
                            f"{'correct' if verdict else 'wrong'} pred={shown}")

    def _format_term(self, completion: str) -> float:
        if self.format_weight == 0.0:
            return 0.0
        return self.format_weight if len(_BOX_RE.findall(completion)) == 1 else -self.format_weight


def math_reward(prompt: str, completion: str, answer: Any) -> RewardResult:
    """The default math reward: `MathReward()` (no format term). See the module docstring for the rules."""
    return _DEFAULT(prompt, completion, answer)


def parse_prediction(completion: str, *, timeout_s: int = 0) -> list:
    """math-verify parse of a completion's final answer (last box, else an anchored answer); [] if none."""
    content = last_boxed(completion)
    if content is None:
        return _parse(completion, _ANCHORED_CONFIG, timeout_s)
    return _parse(_as_math(content), _ANSWER_CONFIG, timeout_s)


def parse_gold(answer: Any, *, timeout_s: int = 0) -> list:
    """math-verify parse of a gold answer given bare, in `$...$`, or with a `\\boxed{}`."""
    text = str(answer).strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = _as_math(boxed)
    elif not re.search(r"(?<!\\)\$", text):  # an escaped \$ is a dollar sign (MATH: "\$18.90"), not math mode
        text = _as_math(text)
    return _parse(text, _ANSWER_CONFIG, timeout_s)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}`; None without a box; "" if it never closes."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1  # braces are counted as written; escaped \\{ \\} come in pairs inside an answer
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return ""


def _as_math(latex: str) -> str:
    """Wrap one answer in $...$; a trailing percent sign goes after it, the only place math-verify reads it."""
    body = " ".join(latex.split())  # inline $...$ may not span lines
    if not body:
        return ""
    pct = _PCT_RE.search(body)
    return f"${body[: pct.start()]}$%" if pct else f"${body}$"


def _parse(text: str, config: tuple, timeout_s: int) -> list:
    if not text:
        return []
    # timeout 0/None disables math-verify's signal alarm; it logs a warning once per process about that.
    return parse(text, list(config), parsing_timeout=timeout_s or None)


def _equivalent(gold: list, pred: list, timeout_s: int, float_rounding: int) -> bool | None:
    """True / False, or None when a comparison timed out (no verdict: scored malformed)."""
    timed_out = False
    for g in gold:
        for p in pred:
            try:
                if verify(g, p, float_rounding=float_rounding, timeout_seconds=timeout_s or None, raise_on_error=True):
                    return True
            except TimeoutException:  # a BaseException in math-verify
                timed_out = True
            except Exception:  # sympy cannot compare these two forms; another pair may still match
                continue
    return None if timed_out else False


def _shown(pred: list) -> str:
    # Only the extracted *string* is shown: str() of a pathological sympy object can itself hang.
    text = next((p for p in reversed(pred) if isinstance(p, str)), "?")
    return repr(text[:80])


_DEFAULT = MathReward()
