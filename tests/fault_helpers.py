"""Fault injection for tests/test_faults.py, importable by `python train.py` runs (and reward worker processes):
a module whose loss turns NaN or whose engine fails on chosen steps, a raising reward, a hanging reward and an
environment whose rollouts stop ending after the first step."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

import torch

from lit_rlvr.data.tasks.arithmetic import arithmetic_reward
from lit_rlvr.envs import TextEnv
from lit_rlvr.module import GRPOModule
from lit_rlvr.rewards.base import RewardResult


class FaultyModule(GRPOModule):
    """GRPO with faults on chosen training-step calls (1-based; a skipped step does not advance global_step):
    `nan_calls` NaN policy loss; `nan_from` NaN from that call on; `engine_fail_call` engine.generate raises;
    `nan_grad_calls` a finite loss whose gradient is NaN, in the first loss pass only (M3PO has several)."""

    def __init__(self, nan_calls: Optional[list[int]] = None, nan_from: int = 0, engine_fail_call: int = 0,
                 nan_grad_calls: Optional[list[int]] = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.nan_calls, self.nan_from, self.engine_fail_call = set(nan_calls or []), nan_from, engine_fail_call
        self.nan_grad_calls = set(nan_grad_calls or [])
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.calls == self.engine_fail_call:  # the step's rollouts meet a broken engine
            self.engine.generate = _broken_generate
        return super().training_step(batch, batch_idx)

    def policy_loss(self, logp, old_logp, advantages, mask, rollouts):
        loss, metrics = super().policy_loss(logp, old_logp, advantages, mask, rollouts)
        if self.calls in self.nan_calls or 0 < self.nan_from <= self.calls:
            loss = loss * torch.tensor(float("nan"))
        first_pass = rollouts.loss_pass is None or int(rollouts.loss_pass[0]) == 0
        if self.calls in self.nan_grad_calls and first_pass:
            loss = _NaNGradient.apply(loss)
        return loss, metrics


class _NaNGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a step whose loss looks fine but whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


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


class StallingEnv(TextEnv):
    """An environment whose first `quick` instances end at once and whose later ones are never done, each step
    taking `step_s` seconds (within env.timeout_s): the first RL step ends, the next cannot. On its first stalled
    step it creates the file `marker` (the test's sign that a step that cannot end is in progress)."""

    instances = 0

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        self.stalls = StallingEnv.instances >= int(self.env_config.get("quick", 4))
        StallingEnv.instances += 1

    def step(self, action: str):
        if not self.stalls:
            return {"observations": "", "reward": 0.0, "done": True, "metadata": {}}
        marker = self.env_config.get("marker")
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
        time.sleep(float(self.env_config.get("step_s", 2.0)))
        return {"observations": "", "reward": 0.0, "done": False, "metadata": {"tool_call": False}}


def announced_slow_reward(prompt: str, completion: str, answer: Any) -> float:
    """The arithmetic reward, 0.2 s a call, saying "REWARD CALLED" on stderr the first time (a test signals the run
    then: during the evaluation before training)."""
    if not getattr(announced_slow_reward, "said", False):
        announced_slow_reward.said = True
        print("REWARD CALLED", file=sys.stderr, flush=True)
    time.sleep(0.2)
    return float(arithmetic_reward(prompt, completion, answer))
