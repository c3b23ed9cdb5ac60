"""Rewards that return values no float can hold, numpy and torch scalars, or that change their arguments: for
tests/test_reward_values.py and its `python train.py` run. Light at import (reward worker processes import it):
numpy and torch are imported inside the functions that return their types."""

from __future__ import annotations

import json
import numbers
import os
from decimal import Decimal
from fractions import Fraction
from typing import Any

from lit_rlvr.rewards.base import RewardResult


class BadFloat(numbers.Real):
    """A `numbers.Real` whose conversion to float raises `error` (a hostile or broken number type)."""

    def __init__(self, error: BaseException):
        self.error = error

    def __float__(self):
        raise self.error

    # the rest of numbers.Real's abstract methods: never called by the contract
    __abs__ = __add__ = __ceil__ = __eq__ = __floor__ = __floordiv__ = __le__ = __lt__ = __mod__ = __mul__ = \
        __neg__ = __pos__ = __pow__ = __radd__ = __rfloordiv__ = __rmod__ = __rmul__ = __round__ = __rpow__ = \
        __rtruediv__ = __truediv__ = __trunc__ = lambda self, *a: NotImplemented
    __hash__ = object.__hash__


def _np():
    import numpy

    return numpy


def _torch():
    import torch

    return torch


# what cannot become a finite float: each is malformed and counted, never a crash
NOT_FINITE = {
    "10**400": lambda: 10 ** 400,
    "-10**400": lambda: -(10 ** 400),
    "Fraction(10**400, 3)": lambda: Fraction(10 ** 400, 3),
    "Decimal('1e400')": lambda: Decimal("1e400"),
    "Decimal('sNaN')": lambda: Decimal("sNaN"),
    "nan": lambda: float("nan"),
    "-inf": lambda: float("-inf"),
    "numpy.float64(inf)": lambda: _np().float64("inf"),
    "numpy.float32(nan)": lambda: _np().float32("nan"),
    "tensor(nan)": lambda: _torch().tensor(float("nan")),
    "tensor(inf, float64)": lambda: _torch().tensor(float("inf"), dtype=_torch().float64),
    "__float__ raises": lambda: BadFloat(RuntimeError("no float for you")),
    "__float__ exits": lambda: BadFloat(SystemExit(3)),
    "RewardResult(10**400)": lambda: RewardResult(10 ** 400, False),
    "RewardResult(Decimal('sNaN'))": lambda: RewardResult(Decimal("sNaN"), False),
    "RewardResult(malformed=array)": lambda: RewardResult(1.0, _np().array([True, False])),
}
# numpy/torch scalars and 0-d arrays/tensors: scores (docs/rewards.md), as float() of the value
SCALARS = {
    "numpy.bool_(True)": (lambda: _np().bool_(True), 1.0),
    "numpy.bool_(False)": (lambda: _np().bool_(False), 0.0),
    "numpy.float32(0.5)": (lambda: _np().float32(0.5), 0.5),
    "numpy.int64(-1)": (lambda: _np().int64(-1), -1.0),
    "numpy.array(0.25)": (lambda: _np().array(0.25), 0.25),
    "tensor(True)": (lambda: _torch().tensor(True), 1.0),
    "tensor(0.75)": (lambda: _torch().tensor(0.75), 0.75),
    "tensor(-1, int64)": (lambda: _torch().tensor(-1), -1.0),
    "tensor(0.5, bfloat16)": (lambda: _torch().tensor(0.5, dtype=_torch().bfloat16), 0.5),
    "Fraction(1, 4)": (lambda: Fraction(1, 4), 0.25),
    "Decimal('0.5')": (lambda: Decimal("0.5"), 0.5),
    "RewardResult(numpy.float32, numpy.bool_)": (lambda: RewardResult(_np().float32(1.0), _np().bool_(False)), 1.0),
    "RewardResult(tensor, tensor)": (lambda: RewardResult(_torch().tensor(-1.0), _torch().tensor(False)), -1.0),
}
# still malformed: not one real number
NOT_A_SCORE = {
    "tensor([1.0])": lambda: _torch().tensor([1.0]),
    "numpy.array([1, 2])": lambda: _np().array([1, 2]),
    "numpy.complex128(1)": lambda: _np().complex128(1),
    "1j": lambda: 1j,
    "'1.0'": lambda: "1.0",
    "[1.0]": lambda: [1.0],
    "RewardResult(1.0, malformed='no')": lambda: RewardResult(1.0, "no"),
}


def by_name(prompt: str, completion: str, answer: Any) -> Any:
    """Returns the value named by the completion, from NOT_FINITE, SCALARS or NOT_A_SCORE."""
    if completion in NOT_FINITE:
        return NOT_FINITE[completion]()
    if completion in SCALARS:
        return SCALARS[completion][0]()
    return NOT_A_SCORE[completion]()


# -- rewards that change their arguments ----------------------------------------------------------------------
def _vandalise(prompt: Any, answer: Any) -> None:
    """Changes everything mutable it was given, in place, as a careless or hostile reward would."""
    if isinstance(answer, list):
        answer.append("extra")
        answer[0] = "changed"
    if isinstance(answer, dict):
        for value in answer.values():
            if isinstance(value, list):
                value.clear()
        answer["injected"] = True
    if isinstance(prompt, list):  # chat messages
        prompt.append({"role": "assistant", "content": "injected"})
        prompt[0]["content"] = "changed"


def mutating(prompt: Any, completion: str, answer: Any) -> float:
    """1.0 when the prompt and answer it sees are the pristine ones ($PRISTINE: a JSON {prompt: answer} map, or
    the test's own), else 0.0; then it changes both in place."""
    key = json.dumps(prompt, sort_keys=True)
    pristine = PRISTINE.get(key, "missing")
    seen = 1.0 if pristine == answer else 0.0
    _vandalise(prompt, answer)
    return seen


PRISTINE: dict[str, Any] = {}
if os.environ.get("PRISTINE"):
    with open(os.environ["PRISTINE"]) as _handle:
        PRISTINE = json.load(_handle)


class MutatingBatch:
    """A reward that scores a whole batch (`score_batch`, like the code sandbox) and changes its arguments."""

    def __call__(self, prompt: Any, completion: str, answer: Any) -> float:
        return mutating(prompt, completion, answer)

    def score_batch(self, prompts: list, completions: list, answers: list) -> list[float]:
        return [mutating(p, c, a) for p, c, a in zip(prompts, completions, answers)]


def hostile(prompt: Any, completion: str, answer: Any) -> Any:
    """For the `python train.py` run: changes its arguments (scoring 1 only while they are pristine), returns
    that score as a numpy bool, a 0-d tensor or a numpy float by turns, and 10**400 for completions of length
    divisible by 5 (each such call appended to $HOSTILE_LOG, so the test knows how many to expect)."""
    seen = mutating(prompt, completion, answer)
    if len(completion) % 5 == 0:
        with open(os.environ["HOSTILE_LOG"], "a") as handle:
            handle.write("overflow\n")
        return 10 ** 400
    kind = len(completion) % 3
    if kind == 0:
        return _np().bool_(seen > 0)
    if kind == 1:
        return _torch().tensor(seen)
    return _np().float32(seen)
