"""The valid ranges of the run's options, in one table that every entry point checks.

`train.py` checks the composed config against it before any work (`lit_rlvr.config.config_check`); the constructors
(`GRPOModule`, `RLVRDataModule`, `SamplingConfig`, `SamplingParams`) check their own arguments against the same
rows, so the Lightning CLI and plain Python reject what `train.py` rejects, with the same line. Keys are the
Hydra config paths; a constructor checks the rows of its section (`algorithm.`, `data.`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping, Optional

from lit_rlvr.config.problems import (INFINITE_OK, check_finite, convert, finite_problem, finite_problems, problem_line,
                                      unknown_key_problems)
from lit_rlvr.functional import ADVANTAGES, AGGREGATIONS, GROUP_FILTER_METRICS, KL_ESTIMATORS, POLICY_LOSSES

__all__ = ["RANGES", "INFINITE_OK", "check_finite", "convert", "finite_problem", "finite_problems",
           "problem_line", "range_problems", "unknown_key_problems"]

Rule = tuple[Callable[[Any], bool], str]  # (is the value valid?, what is expected)


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _at_least(low: int, what: str = "an integer") -> Rule:
    return (lambda v: v >= low, f"{what} >= {low}")


RANGES: dict[str, Rule] = {
    "algorithm.group_size": _at_least(1),
    "algorithm.lr": (lambda v: v > 0, "a number > 0"),
    "algorithm.weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "algorithm.grad_clip": (lambda v: v is None or v >= 0, "a number >= 0 (0 = off) or null"),
    "algorithm.kl_coef": (lambda v: v >= 0, "a number >= 0"),
    "algorithm.kl_estimator": (lambda v: v in KL_ESTIMATORS, f"one of {', '.join(KL_ESTIMATORS)}"),
    "algorithm.loss_aggregation": (lambda v: v in AGGREGATIONS, f"one of {', '.join(AGGREGATIONS)}"),
    "algorithm.policy_loss": (lambda v: v in POLICY_LOSSES, f"one of {', '.join(POLICY_LOSSES)}"),
    "algorithm.advantages": (lambda v: v in ADVANTAGES, f"one of {', '.join(ADVANTAGES)}"),
    "algorithm.eps_low": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "algorithm.eps_high": (lambda v: v >= 0, "a number >= 0"),
    "algorithm.dual_clip": (lambda v: v is None or v > 1, "a number > 1 (the dual-clip bound c; verl: 3.0) or null "
                                                          "(off)"),
    "algorithm.seq_mask_tau": (lambda v: v is None or v > 1, "a number > 1 (the importance mask keeps ratios in "
                                                             "[1/τ, τ]; 3PO's paper: 2) or null (off)"),
    "algorithm.kl_k3_cap": (lambda v: v is None or v > 0, "a number > 0 (verl: 10) or null (no cap)"),
    # training samples a group per prompt: at temperature 0 its completions are one greedy answer, all advantages 0
    "algorithm.temperature": (lambda v: v > 0, "a number > 0 (0 would make every completion of a prompt the same "
                                               "greedy one; use algorithm.eval_temperature=0 for greedy evaluation)"),
    "algorithm.eval_temperature": (lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "algorithm.top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "algorithm.top_k": (lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "algorithm.max_bad_steps": _at_least(1),
    "algorithm.warmup_steps": _at_least(0),
    "algorithm.micro_batch_tokens": (lambda v: v is None or v >= 1, "an integer >= 1 or null (off)"),
    # DAPO's dynamic sampling, verl's names (lit_rlvr.algorithms.filter_groups)
    "algorithm.filter_groups.enable": (lambda v: isinstance(v, bool), "true or false"),
    "algorithm.filter_groups.metric": (lambda v: v in GROUP_FILTER_METRICS,
                                       f"one of {', '.join(GROUP_FILTER_METRICS)}"),
    "algorithm.filter_groups.max_num_gen_batches": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (generation "
                                                    "batches per step, the first included; 0 = no limit)"),
    # DAPO's overlong reward shaping (GRPOModule.compute_advantages)
    "algorithm.overlong_cache_len": _at_least(0),
    "algorithm.overlong_penalty_factor": (lambda v: v >= 0, "a number >= 0 (the largest length penalty; a negative "
                                                            "one would reward length)"),
    **{f"algorithm.{k}": _at_least(1)
       for k in ("ppo_epochs", "mini_batches", "micro_batch_size", "max_new_tokens", "eval_samples")},
    # the in-process engine's batch cap and the post-push check (lit_rlvr.rollout.hf, lit_rlvr.rollout.lora)
    "engine.options.max_batch": _at_least(1),
    "engine.options.sync_check_every": (lambda v: v >= 0, "an integer >= 0 (pushes between checks; 0 = off)"),
    "engine.options.sync_check_tol": (lambda v: v is None or v > 0, "a number > 0 (the largest log-prob gap "
                                                                    "after a push), or null"),
    "data.batch_size": (lambda v: v >= 1, "an integer >= 1 (prompts per RL step)"),
    "data.eval_batch_size": _at_least(1),
    "data.eval_limit": (lambda v: v is None or v >= 1, "an integer >= 1 or null"),
    "trainer.max_steps": (lambda v: v >= 1 or v == -1, "an integer >= 1 (optimizer steps), or -1"),
    "checkpoint_every": _at_least(1),
    "stop_grace_s": (lambda v: not isinstance(v, bool) and v >= 0, "a number of seconds >= 0 (how long a step may "
                                                                    "still run after SIGTERM or Ctrl-C)"),
    "mode": (lambda v: v in ("train", "eval"), "train or eval"),
    # multi-turn environments (lit_rlvr.envs checks them, for every entry point; null: the environment's default)
    "env.max_turns": (lambda v: _integer(v) and v >= 1, "an integer >= 1 (model turns per rollout)"),
    "env.max_tokens": (lambda v: _integer(v) and v >= 1, "an integer >= 1 (response tokens per rollout, model and "
                                                         "observation tokens)"),
    "env.timeout_s": (lambda v: _real(v) and math.isfinite(v) and v > 0, "a finite number of seconds > 0 (one "
                                                                          "environment call)"),
    "env.stop": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v),
                 "a list of non-empty strings (an empty one would end every model turn at its first token)"),
    "env.options": (lambda v: isinstance(v, Mapping), "a mapping of the environment's options"),
    "perf.peak_flops": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
                        "the device's peak FLOP/s, a number > 0 (e.g. 989.4e12: an H100 in bf16), or null (a CPU's "
                        "measured, a GPU's published; docs/mfu.md)"),
}
# one engine call's options (`SamplingParams`): the algorithm's rows, where temperature 0 (greedy) is valid
RANGES.update({f"sampling.{k}": RANGES[f"algorithm.{k}"] for k in ("top_p", "top_k", "max_new_tokens")})
RANGES["sampling.temperature"] = RANGES["algorithm.eval_temperature"]


def lora_rank_problems(engine: Any, engine_name: str, rank: Optional[int], lora_sync: str) -> list[str]:
    """A LoRA rank above what the engine class `engine` serves as adapters (its `max_lora_rank`), one line; checked with
    the config, before the model loads, and by the engine itself."""
    cap = engine.max_lora_rank
    if rank is None or lora_sync != "adapter" or cap is None or rank <= cap:
        return []
    return [f"model.lora.rank={rank}: engine={engine_name} serves LoRA adapters up to rank {cap} "
            "(engine.options.lora_sync=adapter); lower model.lora.rank, or set engine.options.lora_sync=merged"]


def compile_problems(value: Any, sharded: bool) -> list[str]:
    """`model.compile` (the module's `compile_update`): a bool, and not with a sharding strategy (FSDP shards the
    policy's layers; compiling the sharded model is not supported). train.py checks it before any work, the module
    again in setup (the Lightning CLI and Python reach only that)."""
    if value is None or value is False:
        return []
    if value is not True:
        return [problem_line("model.compile", value, "true or false")]
    return [problem_line("model.compile", value, "false with a sharding strategy (FSDP shards the policy's layers; "
                                                 "compiling the sharded model is not supported)")] if sharded else []


def range_problems(values: Mapping[str, Any], section: str, rules: Mapping[str, Rule] = RANGES) -> list[str]:
    """One line per value of config section `section` (e.g. "algorithm", or "" for top-level keys) that its row
    of `rules` rejects, or that is a non-finite float (`finite_problem`: every float, with a row or not)."""
    problems = []
    for name, value in values.items():
        key = f"{section}.{name}" if section else name
        nonfinite = [] if isinstance(value, Mapping) else finite_problems(value, key)  # a dict is another section
        if nonfinite:
            problems += nonfinite
            continue
        if key not in rules:
            continue
        valid, expected = rules[key]
        try:
            ok = valid(value)
        except TypeError:  # e.g. null where a number is needed
            ok = False
        if not ok:
            problems.append(problem_line(key, value, expected))
    return problems


def consistency_problems(options: Mapping[str, Any]) -> list[str]:
    """Rules between algorithm options (a dict of the module's arguments): one line each."""
    problems = []
    cap, estimator = options.get("kl_k3_cap"), options.get("kl_estimator", "k3")
    if cap is not None and estimator not in ("k3", "k3+"):
        problems.append(f"algorithm.kl_k3_cap={cap} caps the k3 estimator: it needs algorithm.kl_estimator=k3 or "
                        f"k3+ (got {estimator!r}); null = no cap")
    if options.get("advantages") == "dr_grpo" and options.get("scale_adv_by_std"):
        problems.append("algorithm.scale_adv_by_std=true contradicts algorithm.advantages=dr_grpo (no std division); "
                        "set algorithm.scale_adv_by_std=false, or algorithm.advantages=grpo")
    if options.get("policy_loss") == "gspo" and options.get("dual_clip") is not None:
        problems.append(f"algorithm.dual_clip={options['dual_clip']} floors per-token PPO terms; algorithm.policy_loss"
                        "=gspo clips one ratio per sequence: set algorithm.dual_clip=null")
    cache, budget = options.get("overlong_cache_len"), options.get("max_new_tokens")
    if cache is not None and budget is not None and cache > budget:
        problems.append(f"algorithm.overlong_cache_len={cache} is longer than algorithm.max_new_tokens={budget}: "
                        "the overlong penalty zone lies within the completion budget")
    return problems


def group_size_problem(group_size: int, counts_set_by: str | None) -> list[str]:
    """A group of one learns nothing (its advantage is r − mean = 0), unless a callback sets the sample counts and
    baselines each group itself (V0.5: `counts_set_by` names it)."""
    if group_size >= 2 or counts_set_by is not None:
        return []
    return [problem_line("algorithm.group_size", group_size, "an integer >= 2 (advantages compare the completions "
                                                             "of one prompt: with 1, every advantage is 0)")]
