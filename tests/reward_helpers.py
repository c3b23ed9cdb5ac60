"""Rewards that break the contract or the clock, for tests/test_reward_faults.py and its `python train.py` runs.

Light on purpose: reward worker processes import this module, and it must not pull in torch or Lightning."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from lit_rlvr.data.tasks.arithmetic import arithmetic_reward
from lit_rlvr.rewards.base import RewardResult


def contract_breaker(prompt: str, completion: str, answer: Any) -> Any:
    """By the completion's length: a plain float, an int, a bool, a str, None, a dict, 1e308, SystemExit,
    KeyboardInterrupt, or the arithmetic reward's RewardResult."""
    kind = len(completion) % 10
    if kind == 7:
        raise SystemExit(3)
    if kind == 8:
        raise KeyboardInterrupt
    return [0.5, 1, True, "1.0", None, {"score": 1.0}, 1e308, None, None,
            arithmetic_reward(prompt, completion, answer)][kind]


_calls = 0


def sleeping_reward(prompt: str, completion: str, answer: Any) -> Any:
    """Hangs in C code (time.sleep: cannot be cut inside the process) for about half of the completions, once
    it has been called more than $HANG_AFTER times (default 0)."""
    global _calls
    _calls += 1
    if len(completion) % 2 == 0 and _calls > int(os.environ.get("HANG_AFTER", "0")):
        time.sleep(3600)
    return arithmetic_reward(prompt, completion, answer)


_blocking_calls = 0


def blocking_reward(prompt: str, completion: str, answer: Any) -> Any:
    """Blocks for an hour in C code (time.sleep: no thread can cut it) once it has been called more than
    $HANG_AFTER times (default 0), touching the file $HANG_MARKER (when set) as it starts to block."""
    global _blocking_calls
    _blocking_calls += 1
    if _blocking_calls > int(os.environ.get("HANG_AFTER", "0")):
        if os.environ.get("HANG_MARKER"):
            open(os.environ["HANG_MARKER"], "a").close()
        time.sleep(3600)
    return arithmetic_reward(prompt, completion, answer)


def looping_reward(prompt: str, completion: str, answer: Any) -> Any:
    """Spins in Python code (can be cut) for completions starting with "loop"."""
    while completion.startswith("loop"):
        pass
    return 1.0


def echo_reward(prompt: str, completion: str, answer: Any) -> Any:
    """"hang": sleeps; "spin": busy loop writing its pid to $PID_DIR first; "modules": a RewardResult, 1.0 when the
    worker did not import torch or Lightning, else -1.0; anything else: the pid of the process that scored it."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "spin":
        with open(os.path.join(os.environ["PID_DIR"], str(os.getpid())), "w"):
            pass
        while True:
            pass
    if completion == "modules":
        heavy = {"torch", "lightning"} & set(sys.modules)
        return RewardResult(-1.0 if heavy else 1.0, False, ",".join(sorted(heavy)))
    return float(os.getpid())


def digit_share(prompt: str, completion: str, answer: Any) -> float:
    """The share of the completion's characters that are digits: rewards that differ within a group even for an
    untrained policy, so a short run has advantages and gradients (the arithmetic reward gives such a policy
    -1 everywhere)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
