"""Fault injection for tests/test_faults.py, importable by `python train.py` runs (and reward worker processes):
a module whose loss turns NaN or whose engine fails on chosen steps, a raising reward and a hanging reward."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch

from lit_rlvr.data.tasks.arithmetic import arithmetic_reward
from lit_rlvr.module import GRPOModule
from lit_rlvr.rewards.base import RewardResult


class FaultyModule(GRPOModule):
    """GRPO with faults on chosen training-step calls (1-based; a skipped step does not advance global_step):
    `nan_calls` NaN policy loss; `nan_from` NaN from that call on; `engine_fail_call` engine.generate raises."""

    def __init__(self, nan_calls: Optional[list[int]] = None, nan_from: int = 0, engine_fail_call: int = 0,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.nan_calls, self.nan_from, self.engine_fail_call = set(nan_calls or []), nan_from, engine_fail_call
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx)

    def policy_loss(self, logp, old_logp, advantages, mask, rollouts):
        loss, metrics = super().policy_loss(logp, old_logp, advantages, mask, rollouts)
        if self.calls in self.nan_calls or 0 < self.nan_from <= self.calls:
            loss = loss * torch.tensor(float("nan"))
        return loss, metrics

    def _engine_generate(self, prompt_token_ids, counts, params):
        if self.calls == self.engine_fail_call:
            self.engine.generate = _broken_generate
        return super()._engine_generate(prompt_token_ids, counts, params)


def _broken_generate(*args: Any, **kwargs: Any):
    raise RuntimeError("injected engine failure (CUDA error: an illegal memory access was encountered)")


def raising_reward(prompt: str, completion: str, answer: Any) -> RewardResult:
    """Raises for about a third of the completions (chosen by the completion's length)."""
    if len(completion) % 3 == 0:
        raise ZeroDivisionError("injected reward crash")
    return arithmetic_reward(prompt, completion, answer)


def hanging_reward(prompt: str, completion: str, answer: Any) -> RewardResult:
    """Hangs for about half of the completions (even length); the process runner's timeout must cut it off."""
    if len(completion) % 2 == 0 and os.environ.get("FAULT_NO_HANG") != "1":
        time.sleep(3600)
    return arithmetic_reward(prompt, completion, answer)
