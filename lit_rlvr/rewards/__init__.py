"""Reward functions by name. A reward is a plain callable ``fn(prompt, completion, answer) -> RewardResult``."""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Optional

from lit_rlvr.rewards.base import (DEFAULT_SCORE_BOUND, DEFAULT_TIMEOUT_S, Failure, RewardBatch, RewardFn,
                                   RewardResult, RewardRunner, copied, plain_result)

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.config.problems import unknown_key_problems
from lit_rlvr.rewards.async_runner import DEFAULT_MAX_CONCURRENT, AsyncRewardRunner, is_async
from lit_rlvr.rewards.checks import is_int, is_number, problem_line
from lit_rlvr.rewards.terms import SHARED_KEYS, build_terms, term_specs
from lit_rlvr.rewards.workers import ProcessRewardRunner

log = logging.getLogger(__name__)

# the runner's options (`build_reward_runner`), besides the reward's own
RUNNER_KEYS = ("isolation", "timeout_s", "score_bound", "workers", "max_concurrent")

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
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward={name!r}: cannot import {target} ({err})") from err


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
                         f"{', '.join(valid)} (and isolation, timeout_s, score_bound, max_concurrent; with "
                         "isolation=process: workers)")
    return obj(**options)


class _BatchRewardRunner(RewardRunner):
    """For rewards that score a whole batch themselves (the code sandbox runs its own worker pool)."""

    def __call__(self, prompts, completions, answers) -> RewardBatch:
        try:  # one copy per completion: scoring one cannot change what the next one (or a later step) sees
            copies = [copied(args) for args in zip(prompts, completions, answers)]
            columns = [[c[i] for c in copies] for i in range(3)]
            results = list(self.fn.score_batch(*columns))
            if len(results) != len(copies):
                raise ValueError(f"score_batch returned {len(results)} results for {len(copies)} completions")
        except BaseException as err:  # reward code is user code: every call of the batch fails, the run goes on
            why = f"{type(err).__name__}: {str(err)[:500]}"
            log.warning("reward score_batch failed: %s (the batch's %d completions scored as malformed)", why,
                        len(prompts))
            return self.contract.batch([self.contract.failed(why)] * len(prompts), len(prompts))
        results = [plain_result(r) for r in results]
        # a batch reward reports its own failures (sandbox errors, a server's) as results whose info says "error"
        results = [self.contract.failed(r.info[5:].lstrip(": ")) if isinstance(r, RewardResult)
                   and r.info.startswith("error") else r for r in results]
        return self.contract.batch(results, sum(isinstance(r, Failure) for r in results))

    def close(self) -> None:
        getattr(self.fn, "close", lambda: None)()


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
            problems += [p.replace(f"{key}.options.", f"{where}.options.") if p.startswith(f"{key}.options.")
                         else p.replace(f"{key}=", f"{where}.reward=", 1)
                         for p in reward_problems(reward, {**shared, **own}, key)]
        return problems
    problems = []
    cap = options.get("max_concurrent")
    if cap is not None and not is_int(cap, 1):
        problems.append(problem_line(f"{key}.options.max_concurrent", cap, "an integer >= 1 (calls in flight)"))
    timeout = options.get("timeout_s")
    if timeout is not None and not (is_number(timeout) and 0 < timeout < float("inf")):
        problems.append(problem_line(f"{key}.options.timeout_s", timeout, "a number of seconds > 0"))
    try:
        obj = _load(name)
    except ValueError as err:
        return problems + [str(err)]
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


def _takes_cap(name: Any) -> bool:
    """Whether `max_concurrent` means something to this reward: it is async, or a class that takes it."""
    obj = _load(name)
    return is_async(obj) or (isinstance(obj, type) and "max_concurrent" in inspect.signature(obj).parameters)


def build_reward_runner(name: str | RewardFn, options: Optional[dict[str, Any]] = None) -> RewardRunner:
    """`options`: `isolation` ("none" | "process"), `timeout_s` (every call's bound, in both modes; also given to
    a reward class that takes it), `score_bound`, `workers` (process), `max_concurrent` (an async reward's calls
    in flight; also given to a class that takes it); the rest go to a reward class. `name="terms"`: weighted
    terms (lit_rlvr/rewards/terms.py), each built here."""
    options = dict(options or {})
    if name == "terms":
        return build_terms(options, build_reward_runner, _takes_cap)
    isolation = options.pop("isolation", "none")
    if isolation not in ("none", "process"):
        raise ValueError(f"reward.options.isolation={isolation!r} is not valid; valid: none, process")
    score_bound = options.pop("score_bound", DEFAULT_SCORE_BOUND)
    obj = _load(name)
    takes = (lambda key: isinstance(obj, type) and key in inspect.signature(obj).parameters)
    max_concurrent = options.get("max_concurrent") if takes("max_concurrent") else options.pop("max_concurrent", None)
    if isolation == "process":  # the runner owns the time bound and the pool; the rest configure the reward
        timeout_s, workers = options.pop("timeout_s", DEFAULT_TIMEOUT_S), options.pop("workers", 2)
        fn = resolve_reward(name, options)
        if is_async(fn):
            raise RewardOptionError([problem_line("reward.options.isolation", isolation, "none for an async reward "
                                                  "(its calls are awaited on an event loop in the training process)")])
        return ProcessRewardRunner(fn, timeout_s=timeout_s, workers=workers, score_bound=score_bound)
    timeout_s = options.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not takes("timeout_s"):
        options.pop("timeout_s", None)  # the runner's bound only (e.g. a plain function takes no options)
    fn = resolve_reward(name, options)  # e.g. the code sandbox takes timeout_s and workers itself
    if is_async(fn):
        return AsyncRewardRunner(fn, timeout_s=timeout_s, score_bound=score_bound,
                                 max_concurrent=DEFAULT_MAX_CONCURRENT if max_concurrent is None else max_concurrent)
    if max_concurrent is not None and not takes("max_concurrent"):
        raise RewardOptionError([f"reward.options.max_concurrent={max_concurrent!r} caps an async reward's calls in "
                           f"flight, and reward={name!r} is not async; remove it (isolation=process with "
                           "reward.options.workers runs sync calls side by side)"])
    if hasattr(fn, "score_batch"):  # bounded by its own sandbox kills
        return _BatchRewardRunner(fn, score_bound=score_bound)
    return RewardRunner(fn, timeout_s=timeout_s, score_bound=score_bound)


__all__ = ["REWARDS", "RewardBatch", "RewardFn", "RewardResult", "RewardRunner", "build_reward_runner",
           "resolve_reward", "reward_problems"]
