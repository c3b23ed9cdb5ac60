"""The typed settings as the schemas of `train.py`'s Hydra groups (structured configs in Hydra's ConfigStore).

conf/config.yaml puts each schema first at its group's package (`- schema/algorithm@algorithm`), so the group's
YAMLs merge onto the class defaults: they hold only what differs, a wrong type or an unknown key is refused while
Hydra composes (`lit_rlvr.app.entry` turns that into the one line), and the composed node converts back to the class
(`OmegaConf.to_object(cfg.model)` is a `ModelConfig`). Registered when this module is imported (by
`lit_rlvr.config.options`, which every part of the library imports; not by `lit_rlvr.config` itself, whose
`problems` and `errors` reward workers import without torch).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from lit_rlvr.config.problems import problem_line, unknown_key_problems
from lit_rlvr.config.settings import (AlgorithmConfig, EngineConfig, EnvConfig, ModelConfig, PerfConfig, RewardConfig,
                                      RolloutConfig)

GROUP = "schema"  # the ConfigStore group: schema/<package>


@dataclass(frozen=True)
class AlgorithmGroup(AlgorithmConfig):
    """The `algorithm` group as train.py composes it: `AlgorithmConfig`'s fields, and the run's `name` (its output
    folder and summary.json's `algorithm`), `_target_` the module class (`GRPOModule` or a subclass of it) and
    `callbacks`, keyed `_target_` mappings (`ParamNoise`, `ValuePrior`)."""

    name: str = "???"  # every algorithm YAML names itself
    _target_: str = "lit_rlvr.module.GRPOModule"
    callbacks: dict[str, Any] = field(default_factory=dict)


SCHEMAS: dict[str, type] = {"algorithm": AlgorithmGroup, "model": ModelConfig, "reward": RewardConfig,
                            "engine": EngineConfig, "env": EnvConfig, "perf": PerfConfig,
                            "rollout": RolloutConfig}
# `algorithm`'s keys that train.py reads besides AlgorithmConfig's
RECIPE_KEYS = ("name", "_target_", "callbacks")


def register() -> None:
    """Store each schema as `schema/<package>` (idempotent: a second call replaces the same entries)."""
    store = ConfigStore.instance()
    for package, cls in SCHEMAS.items():
        node = _writable(OmegaConf.structured(cls))
        if package == "algorithm":  # a module subclass's own arguments are keys of its algorithm YAML too
            OmegaConf.set_struct(node, False)  # (train.py's config check refuses keys that no class takes)
        store.store(group=GROUP, name=package, node=node)


def _writable(node: DictConfig) -> DictConfig:
    """A frozen dataclass's node is read-only at every level; the groups' YAMLs must merge onto it."""
    OmegaConf.set_readonly(node, None)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
    return node


def field_type(key: str) -> Any:
    """The annotation of the typed setting at config path `key` (e.g. "algorithm.lr"), or None if no field has it."""
    section, *names = key.split(".")
    annotation: Any = SCHEMAS.get(section)
    for name in names:
        if not dataclasses.is_dataclass(annotation):
            return None
        annotation = typing.get_type_hints(annotation).get(name)
    return annotation if names else None


def describe(annotation: Any) -> str:
    """What a value of type `annotation` is, in a problem line's words."""
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return f"{describe(args[0])} or null"
    if dataclasses.is_dataclass(annotation):
        return f"a mapping of {{{', '.join(f.name for f in dataclasses.fields(annotation))}}}"
    origin = typing.get_origin(annotation) or annotation
    return names.get(origin) or {list: "a list", tuple: "a list", dict: "a mapping"}.get(origin, "a value")


def composition_problem(err: BaseException) -> Optional[tuple[str, str]]:
    """(one line, the key) for Hydra refusing a value of the wrong type or an unknown key under a typed group while
    it composes (its own message is several lines); None for any other error."""
    cause = err.__cause__
    if not isinstance(cause, (ValidationError, ConfigAttributeError, ConfigKeyError)) or not cause.full_key:
        return None
    key = str(cause.full_key)
    if isinstance(cause, ValidationError):
        annotation = field_type(key)
        return (problem_line(key, cause.value, describe(annotation)), key) if annotation is not None else None
    section, _, name = key.rpartition(".")
    cls = field_type(section) if "." in section else SCHEMAS.get(section)
    if not dataclasses.is_dataclass(cls):
        return None
    return unknown_key_problems(section, [name], [f.name for f in dataclasses.fields(cls)])[0], key


def missing_key(err: BaseException) -> Optional[str]:
    """The key of an override Hydra could not apply because the composed config has no such key (a group without a
    schema: `data`, `trainer`); None for any other error. Its line needs the composed section's keys."""
    cause = err.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        return str(cause.full_key)
    return None


register()
