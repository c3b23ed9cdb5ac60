"""Environments of multi-turn rollouts by name (`env=` config group; docs/environments.md).

`env=none` (the default) is single-turn generation. A name here, a "package.module:Class" path, or `skyrl` (a
skyrl-gym environment by its registry id, `env.options.id`) selects the environment class; `build_environment`
turns the `env` config into the `Environment` the rollout driver runs.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import problem_line, range_problems
from lit_rlvr.envs.base import Message, Observation, StepOutput, TextEnv, score_of
from lit_rlvr.rewards import resolve_reward
from lit_rlvr.rewards.base import DEFAULT_SCORE_BOUND

__all__ = ["ENVS", "ENV_KEYS", "EnvSpec", "Environment", "Message", "Observation", "StepOutput", "TextEnv",
           "build_environment", "env_options", "environment_spec", "own_copy", "score_of", "skyrl_class"]

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
    `init`, or one `step`); `score_bound`: a step reward beyond ±it is malformed (`reward.options.score_bound`).
    Checked against the `env.*` rows of `lit_rlvr.config.options.RANGES` (a `ConfigError`)."""

    make: Callable[[dict[str, Any]], Any]
    stop: tuple[str, ...] = ()
    max_turns: int = 4
    max_tokens: int = 256
    timeout_s: float = 30.0
    name: str = "env"
    extras: dict[str, Any] = field(default_factory=dict)  # added to every rollout's extras
    score_bound: float = DEFAULT_SCORE_BOUND

    def __post_init__(self) -> None:
        limits = {"max_turns": self.max_turns, "max_tokens": self.max_tokens, "timeout_s": self.timeout_s,
                  "stop": self.stop}
        problems = range_problems(limits, "env")
        ConfigError.check(problems)


def _import(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr) if attr else module
    except (ImportError, AttributeError) as err:
        if module_name == "skyrl_gym":
            raise ConfigError([f"env=skyrl needs the skyrl-gym package (pip install skyrl-gym): {err}"]) from err
        raise ConfigError([f"env={target!r}: cannot import it: {err}"]) from err
    except Exception as err:  # noqa: BLE001 - the user's module raised while it was imported: its one line
        raise ConfigError([f"env={target!r}: importing {module_name} raised {type(err).__name__}: {err}"]) from err


ENV_KEYS = ("options", "max_turns", "max_tokens", "timeout_s", "stop")  # the `env` config group's keys but `name`
LIMITS = ("max_turns", "max_tokens", "timeout_s")
# reward options of the runner, not the reward
RUNNER_KEYS = ("isolation", "timeout_s", "score_bound", "workers", "max_concurrent")
# env=skyrl's defaults (as a class's `TextEnv.defaults`): the registry id has none
SKYRL_DEFAULTS = {"max_tokens": 512, "options": {"id": None, "env_config": {}}}


@dataclass(frozen=True)
class EnvSpec:
    """A checked `env` config: the class (None for skyrl-gym), its options and limits with the defaults filled in."""

    cls: Optional[type]
    options: dict[str, Any]
    limits: dict[str, Any]
    stop: tuple[str, ...]


def env_options(config: Any) -> dict[str, Any]:
    """The `env` group's settings but its name (an `EnvConfig`), as `environment_spec` and `build_environment` take
    them."""
    return {key: getattr(config, key) for key in ENV_KEYS}


def default_max_tokens(context: Optional[int]) -> int:
    """`env.max_tokens` where neither the config nor the environment class sets it: `Environment`'s 256, or half the
    model's `context` positions when that is less (the prompt needs the rest: 256 response tokens cannot fit the
    built-in model's 256 positions)."""
    default = Environment.__dataclass_fields__["max_tokens"].default
    return default if context is None else max(1, min(default, context // 2))


def environment_spec(name: Any, env_options: Optional[dict[str, Any]] = None,
                     context: Optional[int] = None) -> Optional[EnvSpec]:
    """The checked config of `env=name` (None for `none`): raises `ConfigError`, one line per problem, before any
    work. A null value takes the default: the class's `defaults`, else `Environment`'s (`max_tokens`: derived from
    the model's `context` positions when known, `default_max_tokens`). train.py's config check, the module's
    constructor (the Lightning CLI, Python) and `build_environment` all come here."""
    if name in NO_ENV:
        return None
    if env_options is not None and not isinstance(env_options, Mapping):
        raise ConfigError([problem_line("env_options", env_options, "a mapping of env options, or null")])
    given = {k: v for k, v in (env_options or {}).items() if v is not None}
    unknown = sorted(set(given) - set(ENV_KEYS))
    if unknown:
        raise ConfigError([f"env.{unknown[0]} is not an env option; valid: {', '.join(ENV_KEYS)}"])
    problems = range_problems(given, "env")
    ConfigError.check(problems)
    target = name if isinstance(name, type) else ENVS.get(name, name)  # Python users may pass the class itself
    if not isinstance(target, type) and (not isinstance(target, str) or ":" not in target and target != "skyrl_gym"):
        raise ConfigError([f"env={name!r} is not valid; use none, one of {', '.join(ENVS)} or 'package.module:Class'"])
    cls = None if target == "skyrl_gym" else target if isinstance(target, type) else _import(target)
    defaults = dict(getattr(cls, "defaults", None) or {}) if cls is not None else dict(SKYRL_DEFAULTS)
    declared = defaults.pop("options", None)
    options = {**(declared or {}), **{k: v for k, v in dict(given.get("options") or {}).items()
                                      if v is not None or k not in (declared or {})}}
    own_stop = tuple(getattr(cls, "stop", ()) or ()) if cls is not None else ()
    stop = tuple(dict.fromkeys((*own_stop, *given.get("stop", ()))))
    fallback = {**{k: Environment.__dataclass_fields__[k].default for k in LIMITS},
                "max_tokens": default_max_tokens(context)}
    limits = {k: given.get(k, defaults.get(k, fallback[k])) for k in LIMITS}
    problems = range_problems({**limits, "stop": stop}, "env")  # the class's own defaults and stop strings too
    extra = sorted(set(options) - set(declared)) if declared else []
    if extra:
        what = "env=skyrl" if cls is None else f"env={getattr(name, '__name__', name)}"
        problems.append(f"env.options.{extra[0]} is not an option of {what}; valid: {', '.join(declared)}")
    if cls is None and not options.get("id"):
        problems.append("env=skyrl needs env.options.id, the skyrl-gym environment's registry id "
                        "(e.g. gsm8k_multi_turn)")
    elif cls is None and not isinstance(options["id"], str):
        problems.append(problem_line("env.options.id", options["id"], "a skyrl-gym registry id (a string)"))
    if cls is None and not isinstance(options.get("env_config"), Mapping):
        problems.append(problem_line("env.options.env_config", options.get("env_config"), "a mapping (the "
                                                                                           "environment's env_config)"))
    problems += cls.option_problems(options) if hasattr(cls, "option_problems") else []
    ConfigError.check(problems)
    if cls is None:
        _import("skyrl_gym")  # named before any work when it is not installed
    return EnvSpec(cls, options, limits, stop)


def build_environment(name: Any, env_options: Optional[dict[str, Any]] = None, *, reward: Any = None,
                      reward_options: Optional[dict[str, Any]] = None,
                      context: Optional[int] = None) -> Optional[Environment]:
    """The `Environment` of `env=name` (None for `none`; a class is used as it is). `env_options`: `max_turns`,
    `max_tokens`, `timeout_s`, `stop` (more stop strings) and `options`, which go to the class as SkyRL's
    `env_config`; an `options.reward` of None becomes `reward` (the run's reward with its `reward_options`, resolved
    once: `lit_rlvr.rewards`); `context`: the model's positions, which a default `max_tokens` fits. Checked by
    `environment_spec`."""
    spec = environment_spec(name, env_options, context)
    if spec is None:
        return None
    options = dict(spec.options)
    if "reward" in options:
        chosen = options["reward"] if options["reward"] is not None else reward
        if chosen is None:
            raise ConfigError([f"env={name}: env.options.reward is null and the run has no reward to use"])
        own = {k: v for k, v in (reward_options or {}).items() if k not in RUNNER_KEYS}
        options["reward"] = chosen if callable(chosen) else resolve_reward(chosen, own)
    if spec.cls is None:
        make: Callable[[dict[str, Any]], Any] = _SkyRLMaker(_import("skyrl_gym").make, options["id"],
                                                            dict(options["env_config"] or {}))
    else:
        make = _ClassMaker(spec.cls, options)
    bound = (reward_options or {}).get("score_bound")
    return Environment(make=make, stop=spec.stop, max_turns=int(spec.limits["max_turns"]),
                       max_tokens=int(spec.limits["max_tokens"]), timeout_s=float(spec.limits["timeout_s"]),
                       name=getattr(name, "__name__", str(name)),
                       score_bound=DEFAULT_SCORE_BOUND if bound is None else float(bound))


def own_copy(config: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of an environment's config for one instance: what one rollout's environment does to it stays
    there (functions, e.g. the reward, are code and stay shared)."""
    return {k: v if callable(v) else copy.deepcopy(v) for k, v in config.items()}


@dataclass(frozen=True)
class _ClassMaker:
    cls: Any
    env_config: dict[str, Any]

    def __call__(self, extras: dict[str, Any]) -> Any:
        return self.cls(env_config=own_copy(self.env_config), extras=extras)


@dataclass(frozen=True)
class _SkyRLMaker:
    make: Callable[..., Any]
    env_id: str
    env_config: dict[str, Any]

    def __call__(self, extras: dict[str, Any]) -> Any:
        return self.make(self.env_id, env_config=own_copy(self.env_config), extras=extras)


def skyrl_class(cls: type) -> type:
    """`cls` (a `TextEnv`) as a skyrl-gym environment class, for `skyrl_gym.register(id, entry_point=...)`:
    skyrl_gym.make accepts only subclasses of its `Env`, and the contract is the same."""
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    return type(cls.__name__, (cls, BaseTextEnv), {"__module__": cls.__module__})
