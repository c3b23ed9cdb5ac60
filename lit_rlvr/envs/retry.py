"""`env=retry`: after a wrong final answer the environment says so and the model may try again.

Each turn is a whole attempt, scored alone by the run's reward. A right answer ends the episode with reward
`discount ** k` (k = attempts before it); a wrong one gets `feedback` as the observation while turns remain
(`env.max_turns`), else ends it with the reward of the last attempt (−1 by the built-in rewards).
"""

from __future__ import annotations

from typing import Any

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import problem_line
from lit_rlvr.envs.base import StepOutput, TextEnv, score_of


class RetryEnv(TextEnv):
    """`env_config`: `reward` (the run's reward function), `discount` (per extra attempt, in (0, 1]), `feedback`."""

    defaults = {"max_turns": 3, "max_tokens": 192, "timeout_s": 10.0,
                "options": {"reward": None, "discount": 0.5, "feedback": "\nWrong, try again.\n"}}

    @classmethod
    def option_problems(cls, options: dict[str, Any]) -> list[str]:
        discount, feedback = options.get("discount"), options.get("feedback")
        problems = []
        if not (isinstance(discount, (int, float)) and not isinstance(discount, bool) and 0.0 < discount <= 1.0):
            problems.append(problem_line("env.options.discount", discount, "a number in (0, 1]"))
        if not isinstance(feedback, str):
            problems.append(problem_line("env.options.feedback", feedback, "a string"))
        return problems

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__({**self.defaults["options"], **(env_config or {})}, extras)
        problems = self.option_problems(self.env_config)
        ConfigError.check(problems)
        self.reward_fn = self.env_config["reward"]
        self.discount, self.feedback = float(self.env_config["discount"]), self.env_config["feedback"]

    def step(self, action: str) -> StepOutput:
        self.turns += 1
        score, malformed = score_of(self.reward_fn(self.prompt, action, self.answer))
        if score > 0:
            return {"observations": "", "reward": score * self.discount ** (self.turns - 1), "done": True,
                    "metadata": {"malformed": False}}
        if self.turns >= self.max_turns:
            return {"observations": "", "reward": score, "done": True, "metadata": {"malformed": malformed}}
        return {"observations": self.feedback, "reward": 0.0, "done": False, "metadata": {"tool_call": False}}
