"""The environment interface of multi-turn rollouts: text in, text out (docs/environments.md).

It is SkyRL's `BaseTextEnv` (skyrl-gym): an environment is built per rollout from its data row, `init(prompt)`
once, then `step(action)` with each model turn's text, returning the observation to append, a reward and whether
the episode is done. A class written for skyrl-gym runs here unchanged (`env=skyrl`); ours run under SkyRL too.
lit-rlvr adds one optional attribute, `stop`: the strings that end a model turn besides the end-of-sequence token
(e.g. "</calc>", so the tool runs as soon as its call is written).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, TypedDict, Union

from lit_rlvr.rewards.base import ContractBreach, plain_result

Message = dict[str, str]  # {"role": ..., "content": ...} (OpenAI chat format)
Observation = Union[str, list[Message]]  # a list of messages (SkyRL), or text to append as it is


class StepOutput(TypedDict, total=False):
    """What `step` returns (SkyRL's `BaseTextEnvStepOutput`)."""

    observations: Observation  # appended to the sequence (not trained on); [] or "" when there is none
    reward: float  # the rollout's reward is the sum of its steps' rewards
    done: bool  # True: the episode ends here
    metadata: dict[str, Any]  # lit-rlvr reads `tool_call` (bool: this step ran a tool) and `malformed` (bool)


class TextEnv:
    """Base class of an environment; one instance per rollout. Built as SkyRL builds its environments:
    `cls(env_config, extras)`, with `extras["reward_spec"]["ground_truth"]` the row's answer, `extras["prompt"]` the
    prompt text and `extras["max_turns"]` the run's turn limit (`env.max_turns`); `env_config` holds `env.options`.

    Subclasses implement `step`; `init` and `close` are optional. `step` may block (a tool call): the driver runs the
    steps of all rollouts at once in threads, each bounded by `env.timeout_s`; an exception or a hang ends that
    rollout as malformed and masked, never the run."""

    stop: tuple[str, ...] = ()  # strings that end a model turn (besides eos); the driver cuts the turn after one
    # the environment's own defaults of the `env` config group's keys (`max_turns`, `max_tokens`, `timeout_s`) and
    # of its `options`: every entry point (train.py, the Lightning CLI, Python) gets them; a config value of null
    # means the default. A class that declares `options` accepts no other option key.
    defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def option_problems(cls, options: dict[str, Any]) -> list[str]:
        """One line per invalid `env.options` value (merged with `defaults`), checked before any work."""
        return []

    def __init__(self, env_config: Optional[dict[str, Any]] = None, extras: Optional[dict[str, Any]] = None):
        self.env_config = dict(env_config or {})
        self.extras = dict(extras or {})
        self.answer = self.extras.get("reward_spec", {}).get("ground_truth")
        self.prompt = self.extras.get("prompt")
        self.max_turns = int(self.extras.get("max_turns", 1))
        self.turns = 0

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        """The prompt the model starts from and metadata. lit-rlvr has tokenized the prompt already: a returned
        prompt other than the given one is ignored (with a warning)."""
        return prompt, {}

    def step(self, action: str) -> StepOutput:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds (called once it is done; not for a hung episode)."""


def score_of(result: Any) -> tuple[float, bool]:
    """(score, malformed) of what a reward function returned, by the reward contract (`plain_result`): a value that
    is not a score raises ValueError, which ends the rollout as the environment's failure."""
    plain = plain_result(result)
    if isinstance(plain, ContractBreach):
        raise ValueError(f"the reward {plain.kind} ({plain.detail})")
    return plain.score, plain.malformed
