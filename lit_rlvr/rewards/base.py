"""Reward functions are plain callables: ``fn(prompt, completion, answer) -> RewardResult``.

`RewardRunner` scores a batch and never lets a reward failure kill the run: an exception (or, with process
isolation, a timeout or a crashed worker) makes that rollout malformed and is counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardResult:
    score: float  # +1 correct, -1 wrong or malformed (binary rewards by default)
    malformed: bool  # no answer could be read from the completion
    info: str = ""


RewardFn = Callable[[str, str, Any], RewardResult]


@dataclass
class RewardBatch:
    scores: Tensor  # [N] float
    malformed: Tensor  # [N] bool
    failures: int  # calls that raised or timed out (each scored as malformed)


class RewardRunner:
    """Scores completions in-process; a raising reward gives `failure_score` and malformed."""

    def __init__(self, fn: RewardFn, failure_score: float = -1.0):
        self.fn = fn
        self.failure_score = failure_score

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> RewardBatch:
        scores, malformed, failures = [], [], 0
        for prompt, completion, answer in zip(prompts, completions, answers):
            try:
                result = self.fn(prompt, completion, answer)
            except Exception as err:  # reward code is user code: count the failure, keep training
                failures += 1
                log.warning("reward function raised %s: %s (scored as malformed)", type(err).__name__, err)
                result = RewardResult(self.failure_score, True, f"error: {err}")
            scores.append(float(result.score))
            malformed.append(bool(result.malformed))
        return RewardBatch(torch.tensor(scores), torch.tensor(malformed, dtype=torch.bool), failures)

    def close(self) -> None:
        pass
