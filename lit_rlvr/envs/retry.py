"""`env=retry`: after a wrong final answer the environment says so and the model may try again.

Each turn is a whole attempt, scored alone by the run's reward. A right answer ends the episode with reward
`discount ** k` (k = attempts before it); a wrong one gets `feedback` as the observation while turns remain
(`env.max_turns`), else ends it with the reward of the last attempt (−1 by the built-in rewards).
"""

from __future__ import annotations

from typing import Any

from lit_rlvr.envs.base import StepOutput, TextEnv, score_of


class RetryEnv(TextEnv):
    """`env_config`: `reward` (the run's reward function), `discount` (per extra attempt, in (0, 1]), `feedback`."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        self.reward_fn = self.env_config["reward"]
        self.discount = float(self.env_config.get("discount", 0.5))
        self.feedback = str(self.env_config.get("feedback", "\nWrong, try again.\n"))
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"env.options.discount={self.discount} must be in (0, 1]")

    def step(self, action: str) -> StepOutput:
        self.turns += 1
        score, malformed = score_of(self.reward_fn(self.prompt, action, self.answer))
        if score > 0:
            return {"observations": "", "reward": score * self.discount ** (self.turns - 1), "done": True,
                    "metadata": {"malformed": False}}
        if self.turns >= self.max_turns:
            return {"observations": "", "reward": score, "done": True, "metadata": {"malformed": malformed}}
        return {"observations": self.feedback, "reward": 0.0, "done": False, "metadata": {"tool_call": False}}
