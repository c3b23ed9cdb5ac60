"""`GRPOModule`'s arguments as typed settings (`lit_rlvr.config.settings`).

Each group may be given as its settings object, as a mapping of its fields (the Lightning CLI's nested keys, a
checkpoint's saved hyperparameters), or by its usual shorthand (`model="tiny"`, `reward="math"`, `engine="vllm"`,
`env="calculator"`); a notebook may also give any setting as a flat keyword (`lr=1e-4`, `group_size=4`,
`model_options={...}`), the constructor's arguments before the settings were typed, so old checkpoints load too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, Mapping, Optional

from torch import nn

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import compile_problems, consistency_problems, range_problems
from lit_rlvr.config.problems import checked_fields, convert, finite_problems, problem_line, unknown_key_problems
from lit_rlvr.config.settings import (AlgorithmConfig, EngineConfig, EnvConfig, ModelConfig, PerfConfig, RewardConfig,
                                      RolloutConfig)

# flat keyword -> (group, field); None: the keyword is a mapping of the group's fields
SHORTCUTS: dict[str, tuple[str, Optional[str]]] = {
    "model_options": ("model", "options"), "dtype": ("model", "dtype"), "lora": ("model", "lora"),
    "compile_update": ("model", "compile"), "chat_template": ("model", "chat_template"),
    "reward_options": ("reward", "options"), "engine_options": ("engine", "options"),
    "env_options": ("env", None), "perf_options": ("perf", None), "rollout_options": ("rollout", None),
    **{f.name: ("algorithm", f.name) for f in fields(AlgorithmConfig)},
}
GROUPS = {"model": ModelConfig, "algorithm": AlgorithmConfig, "reward": RewardConfig, "engine": EngineConfig,
          "env": EnvConfig, "perf": PerfConfig, "rollout": RolloutConfig}


@dataclass(frozen=True)
class ModuleSettings:
    """Every setting a `GRPOModule` runs with, typed: one object per config group, and the run seed."""

    model: ModelConfig
    algorithm: AlgorithmConfig
    reward: RewardConfig
    engine: EngineConfig
    env: EnvConfig
    perf: PerfConfig
    rollout: RolloutConfig = RolloutConfig()
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Nested plain values (the module's saved hyperparameters): `module_settings` reads them back."""
        return {f.name: asdict(v) if is_dataclass(v) else v for f in fields(self) for v in [getattr(self, f.name)]}

    def problems(self) -> list[str]:
        """The rules of the range table that train.py checks too (lit_rlvr.config.options) that need no model:
        ranges, finite numbers, consistency; one line each."""
        algo = self.algorithm
        flat = {f.name: getattr(algo, f.name) for f in fields(algo) if not is_dataclass(getattr(algo, f.name))}
        sections = {"model.options": self.model.options,  # (LoraOptions and RolloutCorrection check their own)
                    "reward.options": self.reward.options, "engine.options": self.engine.options,
                    "env": asdict(self.env), "perf": asdict(self.perf),
                    "algorithm.optimizer_options": algo.optimizer_options}
        return (range_problems(flat, "algorithm")
                + range_problems(asdict(algo.filter_groups), "algorithm.filter_groups")
                + [p for key, section in sections.items() for p in finite_problems(section, key)]
                + consistency_problems(flat) + compile_problems(self.model.compile, sharded=False)
                + self.async_problems())

    def async_problems(self) -> list[str]:
        """What `rollout.mode=async` cannot run with, one line each (docs/async.md)."""
        if self.rollout.mode != "async":
            return (["rollout.partial_rollout=true needs rollout.mode=async (a synchronous run pushes between batches)"]
                    if self.rollout.partial_rollout else [])
        algo, problems = self.algorithm, []
        correction = algo.rollout_correction
        if not correction.bypass and correction.rollout_is is None:
            problems.append("rollout.mode=async with algorithm.rollout_correction.bypass_mode=false and no rollout_is: "
                            "pi_old would be recomputed with the current weights and the loss would not correct for "
                            "the lag; set bypass_mode=null (the engine's log-probs are pi_old) or rollout_is=token "
                            "(the decoupled objective)")
        if algo.filter_groups.enable:
            problems.append("rollout.mode=async with algorithm.filter_groups.enable=true: dynamic sampling reads "
                            "further batches within a step, which the producer has already taken; use one of the two")
        if self.engine.name == "hf" and self.engine.options.get("mode") not in (None, "copy"):
            problems.append(f"rollout.mode=async with engine.options.mode={self.engine.options['mode']!r}: the "
                            "producer generates while the trainer changes its weights, so the engine needs its own "
                            "copy; set engine.options.mode=copy (the default in async mode)")
        if self.rollout.partial_rollout and self.engine.name.endswith("_server"):
            problems.append(f"rollout.partial_rollout=true with engine={self.engine.name}: a server engine takes "
                            "pushes between batches only (no push lands in a batch being generated yet); set "
                            "rollout.partial_rollout=false")
        if self.rollout.partial_rollout and self.engine.name != "hf" and self.rollout.kv_at_swap != "recompute":
            problems.append(f"rollout.partial_rollout=true with engine={self.engine.name} and rollout.kv_at_swap="
                            f"{self.rollout.kv_at_swap}: an unfinished completion goes on as a new request, whose "
                            "prefix the new weights compute again; set rollout.kv_at_swap=recompute")
        if self.rollout.partial_rollout and self.engine.options.get("sync_check_every", 1) == 1:
            problems.append("rollout.partial_rollout=true with engine.options.sync_check_every=1: the post-push check "
                            "samples with the engine, so every push would wait for its batch to end and none would "
                            "land mid-batch; set engine.options.sync_check_every=0 (off) or k > 1 (every k-th push "
                            "waits and is checked)")
        if algo.optimizer == "ivon" and self.rollout.stale_strategy == "drop":
            problems.append("rollout.mode=async with algorithm.optimizer=ivon (3PO) and rollout.stale_strategy=drop: "
                            "a 3PO batch keeps the version it was planned at and drop plans one batch further ahead, "
                            "so every batch would arrive too stale and be generated again; use stale_strategy=wait")
        if self.rollout.partial_rollout and algo.optimizer == "ivon":
            problems.append("rollout.partial_rollout=true with algorithm.optimizer=ivon (3PO): a completion drawn by "
                            "a weight sample would continue under the new mean, not a sample; set "
                            "rollout.partial_rollout=false")
        return problems


def build(cls: type, value: Any, section: str) -> Any:
    """`value` (an instance, a mapping of the fields, or None for the defaults) as an instance of settings class
    `cls`; nested settings classes from nested mappings. Unknown keys: one line each, naming a close match."""
    if isinstance(value, cls):
        return value
    given = checked_fields(cls, value, section)
    for f in fields(cls):
        if f.name not in given:
            continue
        if isinstance(f.default_factory, type) and is_dataclass(f.default_factory):  # a nested settings class
            given[f.name] = build(f.default_factory, given[f.name], f"{section}.{f.name}")
        elif f.default_factory is dict and given[f.name] is None:  # an options mapping: null = none given
            given[f.name] = {}
    return cls(**given)


def module_settings(model: Any, algorithm: Any, reward: Any, engine: Any, env: Any, perf: Any, seed: int,
                    shortcuts: Mapping[str, Any], rollout: Any = None) -> ModuleSettings:
    """The typed settings of `GRPOModule(model, algorithm, reward, engine, env, perf, rollout, seed, **shortcuts)`;
    `model` may also be an `nn.Module` (its `name_or_path` is then its class name: the module keeps the object)."""
    shorthand = {"model": "name_or_path", "reward": "name", "engine": "name", "env": "name"}
    given = {"model": model, "algorithm": algorithm, "reward": reward, "engine": engine, "env": env, "perf": perf,
             "rollout": rollout}
    groups = {}
    for group, cls in GROUPS.items():
        value = given[group]
        if group in shorthand and value is not None and not isinstance(value, (cls, Mapping)):
            if group == "model" and isinstance(value, nn.Module):  # the object itself: the module keeps it
                value = type(value).__name__
            elif group in ("model", "engine") and not isinstance(value, str):
                extra = ", or an nn.Module with its tokenizer" if group == "model" else ""
                raise ConfigError([problem_line(group, value, f"a name, a {cls.__name__} or a mapping of its "
                                                              f"fields{extra}")])
            value = {shorthand[group]: value}
        groups[group] = build(cls, value, group)
    problems = unknown_key_problems("", list(shortcuts), SHORTCUTS)
    ConfigError.check(problems)
    given_typed = {g for g, cls in GROUPS.items() if isinstance(given[g], Mapping) or (
        isinstance(given[g], cls) and given[g] != cls())}  # (a signature's default instance is not "given")
    mixed = sorted({SHORTCUTS[key][0] for key in shortcuts} & given_typed)
    if mixed:  # which would win is not obvious: say it once instead
        keys = ", ".join(k for k in shortcuts if SHORTCUTS[k][0] == mixed[0])
        raise ConfigError([f"{keys} and {mixed[0]}= both set {mixed[0]} settings: give them in one place (the "
                           f"{GROUPS[mixed[0]].__name__}, or the keywords alone)"])
    for key, value in shortcuts.items():
        group, name = SHORTCUTS[key]
        values = dict(value or {}) if name is None else {name: value}  # None: a mapping of the group's fields
        groups[group] = build(GROUPS[group], {**_fields(groups[group]), **values}, group)
    return ModuleSettings(seed=convert("seed", seed, int), **groups)


def _fields(settings: Any) -> dict[str, Any]:
    return {f.name: getattr(settings, f.name) for f in fields(settings)}
