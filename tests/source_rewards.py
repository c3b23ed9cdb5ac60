"""Rewards for tests/test_rewards_*.py (weighted terms, async rewards) and their train.py runs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from lit_rlvr.data.tasks.arithmetic import arithmetic_reward
from lit_rlvr.rewards.base import RewardResult


def only_digits(prompt: Any, completion: str, answer: Any) -> Any:
    """Scores completions of digits (1.0), returns None for the rest: a term for part of a multi-task batch."""
    return 1.0 if completion.isdigit() else None


def never(prompt: Any, completion: str, answer: Any) -> Any:
    return None


def by_kind(prompt: Any, completion: str, answer: Any) -> Any:
    """"raise": raises; "str": breaks the contract; "sleep": sleeps 10 s; "bad": malformed; else 0.5."""
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "str":
        return "0.5"
    if completion == "sleep":
        time.sleep(10)
    if completion == "bad":
        return RewardResult(-1.0, True)
    return 0.5


async def async_by_kind(prompt: Any, completion: str, answer: Any) -> Any:
    """Awaits `answer` seconds (a number), then: "raise" raises, "str" breaks the contract, "block" blocks the loop
    in sync code for 3 s, else returns 1.0."""
    await asyncio.sleep(float(answer or 0))
    if completion == "raise":
        raise ValueError("async boom")
    if completion == "str":
        return "1.0"
    if completion == "block":
        time.sleep(3)
    return 1.0


class Inflight:
    """An async reward object that records the most calls in flight at once."""

    def __init__(self, delay_s: float = 0.05):
        self.delay_s, self.now, self.most = delay_s, 0, 0

    async def __call__(self, prompt: Any, completion: str, answer: Any) -> float:
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(self.delay_s)
        self.now -= 1
        return 1.0


async def async_arithmetic(prompt: Any, completion: str, answer: Any) -> Any:
    """The arithmetic reward after a 10 ms await (an external call's latency): a train.py run's async reward."""
    await asyncio.sleep(0.01)
    return arithmetic_reward(prompt, completion, answer)
