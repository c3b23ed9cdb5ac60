"""Environments of multi-turn rollouts by name (`env=` config group; docs/environments.md).

`env=none` (the default) is single-turn generation. A name here, a "package.module:Class" path, or `skyrl` (a
skyrl-gym environment by its registry id, `env.options.id`) selects the environment class; `build_environment`
turns the `env` config into the `Environment` the rollout driver runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lit_rlvr.envs.base import Message, Observation, StepOutput, TextEnv, score_of

__all__ = ["ENVS", "ENV_KEYS", "Environment", "Message", "Observation", "StepOutput", "TextEnv", "build_environment",
           "score_of", "skyrl_class"]

ENVS = {
    "calculator": "lit_rlvr.envs.calculator:CalculatorEnv",
    "retry": "lit_rlvr.envs.retry:RetryEnv",
    "skyrl": "skyrl_gym",  # skyrl_gym.make(env.options.id, env_config=..., extras=...)
}
NO_ENV = (None, "none")


@dataclass(frozen=True)
class Environment:
    """What the rollout driver needs to run multi-turn rollouts: how to build one environment per rollout
    (`make(extras)`; `extras` as SkyRL gives them), the stop strings of a model turn, and the limits.

    `max_turns`: model turns per rollout; `max_tokens`: response tokens per rollout, model and observation tokens
    together (the sequence the trainer runs); `timeout_s`: bound of one environment call (construction with
    `init`, or one `step`)."""

    make: Callable[[dict[str, Any]], Any]
    stop: tuple[str, ...] = ()
    max_turns: int = 4
    max_tokens: int = 256
    timeout_s: float = 30.0
    name: str = "env"
    extras: dict[str, Any] = field(default_factory=dict)  # added to every rollout's extras

    def __post_init__(self) -> None:
        problems = [f"env.{k}={v} must be {what}" for k, v, ok, what in (
            ("max_turns", self.max_turns, self.max_turns >= 1, "an integer >= 1"),
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, "an integer >= 1"),
            ("timeout_s", self.timeout_s, self.timeout_s > 0, "a number > 0")) if not ok]
        if problems:
            raise ValueError("; ".join(problems))


def _import(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr) if attr else module
    except (ImportError, AttributeError) as err:
        hint = " (pip install skyrl-gym)" if module_name == "skyrl_gym" else ""
        raise ValueError(f"env={target!r}: cannot import it{hint}: {err}") from err


ENV_KEYS = ("options", "max_turns", "max_tokens", "timeout_s", "stop")  # the `env` config group's keys but `name`
# reward options of the runner, not the reward
RUNNER_KEYS = ("isolation", "timeout_s", "score_bound", "workers", "max_concurrent")


def build_environment(name: Any, env_options: Optional[dict[str, Any]] = None, *, reward: Any = None,
                      reward_options: Optional[dict[str, Any]] = None) -> Optional[Environment]:
    """The `Environment` of `env=name` (None for `none`; a class is used as it is). `env_options`: `max_turns`,
    `max_tokens`, `timeout_s`, `stop` (more stop strings) and `options`, which go to the class as SkyRL's
    `env_config`; an `options.reward` of None becomes `reward` (the run's reward with its `reward_options`, resolved
    once: `lit_rlvr.rewards`)."""
    env_options = dict(env_options or {})
    unknown = sorted(set(env_options) - set(ENV_KEYS))
    if unknown:
        raise ValueError(f"env.{unknown[0]} is not an env option; valid: {', '.join(ENV_KEYS)}")
    options = dict(env_options.get("options") or {})
    max_turns, max_tokens = env_options.get("max_turns", 4), env_options.get("max_tokens", 256)
    timeout_s, stop = env_options.get("timeout_s", 30.0), tuple(env_options.get("stop") or ())
    if name in NO_ENV:
        return None
    if "reward" in options:
        from lit_rlvr.rewards import resolve_reward

        chosen = options["reward"] if options["reward"] is not None else reward
        if chosen is None:
            raise ValueError(f"env={name}: env.options.reward is null and the run has no reward to use")
        own = {k: v for k, v in (reward_options or {}).items() if k not in RUNNER_KEYS}
        options["reward"] = chosen if callable(chosen) else resolve_reward(chosen, own)
    target = name if isinstance(name, type) else ENVS.get(name, name)  # Python users may pass the class itself
    if isinstance(target, str) and ":" not in target and target != "skyrl_gym":
        raise ValueError(f"env={name!r} is not valid; use none, one of {', '.join(ENVS)} or 'package.module:Class'")
    if target == "skyrl_gym":
        env_id = options.pop("id", None)
        if not env_id:
            raise ValueError("env=skyrl needs env.options.id, the skyrl-gym environment's registry id "
                             "(e.g. gsm8k_multi_turn)")
        config = options.pop("env_config", {}) or {}
        if options:
            raise ValueError(f"env.options.{sorted(options)[0]} is not an option of env=skyrl; valid: id, env_config")
        gym = _import("skyrl_gym")
        make = _SkyRLMaker(gym.make, env_id, config)
        own_stop: tuple[str, ...] = ()
    else:
        cls = target if isinstance(target, type) else _import(target)
        make = _ClassMaker(cls, options)
        own_stop = tuple(getattr(cls, "stop", ()) or ())
    return Environment(make=make, stop=tuple(dict.fromkeys((*own_stop, *stop))), max_turns=int(max_turns),
                       max_tokens=int(max_tokens), timeout_s=float(timeout_s),
                       name=getattr(name, "__name__", str(name)))


@dataclass(frozen=True)
class _ClassMaker:
    cls: Any
    env_config: dict[str, Any]

    def __call__(self, extras: dict[str, Any]) -> Any:
        return self.cls(env_config=dict(self.env_config), extras=extras)


@dataclass(frozen=True)
class _SkyRLMaker:
    make: Callable[..., Any]
    env_id: str
    env_config: dict[str, Any]

    def __call__(self, extras: dict[str, Any]) -> Any:
        return self.make(self.env_id, env_config=dict(self.env_config), extras=extras)


def skyrl_class(cls: type) -> type:
    """`cls` (a `TextEnv`) as a skyrl-gym environment class, for `skyrl_gym.register(id, entry_point=...)`:
    skyrl_gym.make accepts only subclasses of its `Env`, and the contract is the same."""
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    return type(cls.__name__, (cls, BaseTextEnv), {"__module__": cls.__module__})
