"""An environment of your own, in one class: after a wrong answer it gives the right answer's last digit as a
hint, and the model answers once more (docs/environments.md walks through it).

    python train.py --config-dir examples/environments env=digit_hint     (env/digit_hint.yaml beside this file)

It follows skyrl-gym's `BaseTextEnv` contract, so it runs under SkyRL too (`skyrl_gym.register` it).
"""

from __future__ import annotations

from typing import Any

from lit_rlvr.envs import TextEnv, score_of


class DigitHintEnv(TextEnv):
    """`env_config`: `reward` (the run's reward function, filled in by lit-rlvr when null), `bonus`: the reward of a
    right answer after the hint (a right first answer gets the reward's own +1)."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)  # sets self.prompt, self.answer (the row's), self.max_turns
        self.reward_fn = self.env_config["reward"]
        self.bonus = float(self.env_config.get("bonus", 0.5))

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        score, malformed = score_of(self.reward_fn(self.prompt, action, self.answer))
        if score > 0 or self.turns >= self.max_turns:  # right, or no turn left: the episode ends
            reward = score if self.turns == 1 or score <= 0 else self.bonus
            return {"observations": "", "reward": reward, "done": True, "metadata": {"malformed": malformed}}
        hint = f"\nNo. It ends in {str(self.answer)[-1]}.\n"  # the observation: in the sequence, never trained on
        return {"observations": hint, "reward": 0.0, "done": False, "metadata": {"tool_call": False}}
