"""Reward functions by name. A reward is a plain callable ``fn(prompt, completion, answer) -> RewardResult``."""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Optional

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.config.problems import unknown_key_problems
from lit_rlvr.rewards.async_runner import AsyncRewardRunner, is_async
from lit_rlvr.rewards.base import RewardBatch, RewardFn, RewardResult, RewardRunner, Runner
from lit_rlvr.rewards.batch import BatchRewardRunner
from lit_rlvr.rewards.checks import problem_line
from lit_rlvr.rewards.options import PASSED_ON, RUNNER_KEYS, RunnerOptions
from lit_rlvr.rewards.terms import SHARED_KEYS, build_terms, term_specs
from lit_rlvr.rewards.workers import ProcessRewardRunner

log = logging.getLogger(__name__)

# name -> "module:attribute"; a class is instantiated with the reward options, a function used as is
REWARDS = {
    "arithmetic": "lit_rlvr.data.tasks.arithmetic:arithmetic_reward",
    "arithmetic_cot": "lit_rlvr.data.tasks.arithmetic_cot:arithmetic_cot_reward",
    "math": "lit_rlvr.rewards.math:MathReward",
    "code": "lit_rlvr.rewards.code:CodeReward",
    "format": "lit_rlvr.rewards.terms:FormatReward",  # 1/0: the completion has the expected form (a term)
    "length": "lit_rlvr.rewards.terms:LengthReward",  # 0 .. -1: DAPO's soft overlong punishment on text (a term)
    "remote": "lit_rlvr.rewards.remote:RemoteReward",  # a reward server by URL (OpenRLHF's /get_reward)
    "model": "lit_rlvr.rewards.model:ModelReward",  # a sequence-classification reward model (a local HF folder)
    "judge": "lit_rlvr.rewards.judge:JudgeReward",  # an LLM judge over an OpenAI-compatible chat API (async)
}


def _load(name: str | RewardFn) -> Any:
    if callable(name):  # Python users may pass the function (or class) itself
        return name
    target = REWARDS.get(name, name)
    if ":" not in target:
        raise ValueError(f"reward={name!r} is not valid; use one of {', '.join(REWARDS)} or 'package.module:function'")
    module_name, attr = target.split(":", 1)
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward={name!r}: cannot import {target} ({err})") from err
    if not callable(obj) and not hasattr(obj, "score_batch"):  # every call of the run would fail, counted
        raise ValueError(f"reward={name!r}: {target} is a {type(obj).__name__}, not a reward: name a function "
                         "fn(prompt, completion, answer) -> score, a class, or an object with score_batch")
    return obj


def resolve_reward(name: str | RewardFn, options: Optional[dict[str, Any]] = None) -> RewardFn:
    """A built-in name (see `REWARDS`), any "package.module:attribute" path, or the callable itself."""
    obj = _load(name)
    options = dict(options or {})
    if not isinstance(obj, type):
        if options:  # a plain function has nothing to take them: they would be dropped without a word
            raise ValueError(f"reward={name!r} is a function and takes no options; got reward.options keys "
                             f"{sorted(options)}")
        return obj
    valid = [p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")]
    unknown = sorted(set(options) - set(valid))
    if unknown and "kwargs" not in inspect.signature(obj).parameters:
        raise ValueError(f"reward={name!r}: reward.options {unknown} are not options of {obj.__name__}; valid: "
                         f"{', '.join(valid)} (and the runner's: {', '.join(RUNNER_KEYS)})")
    return obj(**options)


def reward_problems(name: Any, options: Optional[dict[str, Any]] = None, key: str = "reward") -> list[str]:
    """The settings of the reward sources checked before any work (train.py's config check and the module's
    constructor): one line each, naming the key. A class with a `check_options(options)` classmethod checks its
    own (e.g. `remote` opens a connection to its server); `terms` checks each term."""
    options = dict(options or {})
    if name == "terms":
        specs, problems = term_specs(options.get("terms"), f"{key}.options.terms")
        shared = {k: options[k] for k in SHARED_KEYS if k in options}
        for term, reward, _, own in specs:
            where = f"{key}.options.terms.{term}"
            common = {k: v for k, v in shared.items()  # a valid shared cap goes only where it means something
                      if k != "max_concurrent" or RunnerOptions.problems({k: v}) or _takes_cap(reward, default=True)}
            problems += [p.replace(f"{key}.options.", f"{where}.options.") if p.startswith(f"{key}.options.")
                         else p.replace(f"{key}=", f"{where}.reward=", 1)
                         for p in reward_problems(reward, {**common, **own}, key)]
        return problems
    problems = RunnerOptions.problems(options, f"{key}.options")
    try:
        obj = _load(name)
    except ValueError as err:
        return problems + [str(err)]
    if not problems:
        runner, _ = RunnerOptions.split(options)
        takes = (lambda k: isinstance(obj, type) and k in inspect.signature(obj).parameters)
        problems = [p.replace("reward.options.", f"{key}.options.", 1).replace("reward=", f"{key}=", 1)
                    for p in _unused_runner_keys(name, obj, runner, options, takes)]
    check = getattr(obj, "check_options", None) if isinstance(obj, type) else None
    own = list(check(options)) if check is not None else []
    own += [line for line in unknown_option_problems(obj, name, options, key) if _key(line) not in map(_key, own)]
    named = {_key(line) for line in problems}  # a class that checks the same key again adds no second line
    return problems + [line for line in own if _key(line) not in named]


def _key(line: str) -> str:
    return line.split(" ", 1)[0].split("=", 1)[0]


def unknown_option_problems(obj: Any, name: Any, options: dict[str, Any], key: str = "reward") -> list[str]:
    """The reward options that the reward `obj` (loaded from `name`) would be given and does not take, one line each
    naming the key, before any work (`resolve_reward` refuses them again when it builds the reward)."""
    given = sorted(k for k in options if k not in RUNNER_KEYS)
    if not given:
        return []
    if not isinstance(obj, type):
        return [f"{key}.options.{k} is not an option: reward={name!r} is a function and takes none" for k in given]
    params = inspect.signature(obj).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    return unknown_key_problems(f"{key}.options", given, [*(p for p in params if p not in ("self", "args")),
                                                          *RUNNER_KEYS])


def _takes_cap(name: Any, default: bool = False) -> bool:
    """Whether `max_concurrent` means something to this reward: it is async, or a class that takes it (`default`
    for a name that cannot be loaded: its own line says so)."""
    try:
        obj = _load(name)
    except ValueError:
        return default
    return is_async(obj) or (isinstance(obj, type) and "max_concurrent" in inspect.signature(obj).parameters)


def build_reward_runner(name: str | RewardFn, options: Optional[dict[str, Any]] = None) -> Runner:
    """The runner of reward `name` with `reward.options` `options`: the runner's keys (`RunnerOptions`:
    `isolation`, `timeout_s`, `score_bound`, `workers`, `max_concurrent`) choose and set up the runner, the rest
    configure a reward class; a runner key that the class also takes as an argument (`PASSED_ON`) is given to it
    too, except `timeout_s` and `workers` under isolation=process (the pool's own). `name="terms"`: weighted terms
    (lit_rlvr/rewards/terms.py), each built here."""
    options = dict(options or {})
    if name == "terms":
        return build_terms(options, build_reward_runner, _takes_cap)
    runner, own = RunnerOptions.split(options)
    obj = _load(name)
    takes = (lambda key: isinstance(obj, type) and key in inspect.signature(obj).parameters)
    kept = ("max_concurrent",) if runner.isolation == "process" else PASSED_ON
    own.update({k: options[k] for k in kept if k in options and takes(k)})
    problems = _unused_runner_keys(name, obj, runner, options, takes)
    if problems:
        raise RewardOptionError(problems)
    fn = resolve_reward(name, own)
    if runner.isolation == "process":
        return ProcessRewardRunner(fn, runner)
    if is_async(fn):
        return AsyncRewardRunner(fn, runner)
    if hasattr(fn, "score_batch"):  # bounded by its own kills and timeouts
        return BatchRewardRunner(fn, runner)
    return RewardRunner(fn, runner)


def _unused_runner_keys(name: Any, obj: Any, runner: RunnerOptions, options: dict[str, Any], takes: Any) -> list[str]:
    """Runner keys that would mean nothing for this reward (accepted and then ignored otherwise): one line each."""
    problems = []
    if runner.isolation == "process" and is_async(obj):
        problems.append(problem_line("reward.options.isolation", "process", "none for an async reward (its calls "
                                     "are awaited on an event loop in the training process)"))
    cap = options.get("max_concurrent")
    if cap is not None and not (is_async(obj) or takes("max_concurrent")):
        problems.append(f"reward.options.max_concurrent={cap!r} caps an async reward's calls in flight, and "
                        f"reward={name!r} is not async; remove it (isolation=process with reward.options.workers "
                        "runs sync calls side by side)")
    if "workers" in options and runner.isolation == "none" and not takes("workers"):
        problems.append(f"reward.options.workers={options['workers']!r} sets the worker processes of "
                        f"reward.options.isolation=process, and reward={name!r} runs in the training process "
                        "(isolation=none); set isolation=process, or remove workers")
    return problems


__all__ = ["REWARDS", "RUNNER_KEYS", "RewardBatch", "RewardFn", "RewardResult", "RewardRunner", "Runner",
           "RunnerOptions", "build_reward_runner", "resolve_reward", "reward_problems"]
