"""The valid ranges of the run's options, in one table that every entry point checks: the typed settings' fields
carry their own (`lit_rlvr.config.settings`), the keys of mapping-valued sections and the top level are listed here.

`train.py` checks the composed config against it before any work (`lit_rlvr.app.config_check`); the constructors
(`GRPOModule`, `RLVRDataModule`, `SamplingConfig`, `SamplingParams`) check their own arguments against the same
rows, so the Lightning CLI and plain Python reject what `train.py` rejects, with the same line. Keys are the
Hydra config paths; a constructor checks the rows of its section (`algorithm.`, `data.`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Mapping, Optional

from lit_rlvr.config.problems import (INFINITE_OK, check_finite, convert, finite_problem, finite_problems, problem_line,
                                      unknown_key_problems)
from lit_rlvr.config.schemas import SCHEMAS
from lit_rlvr.config.settings import SEED, DataConfig, Rule, at_least, rows

__all__ = ["RANGES", "INFINITE_OK", "check_finite", "convert", "finite_problem", "finite_problems",
           "problem_line", "range_problems", "unknown_key_problems"]

# the typed settings' rows (`setting(default, rule)` of lit_rlvr.config.settings), then the keys no dataclass has
RANGES: dict[str, Rule] = {key: rule for section, cls in SCHEMAS.items() for key, rule in rows(cls, section)}
RANGES.update(rows(DataConfig, "data"))  # the data group's (RLVRDataModule's arguments; no Hydra schema: its
RANGES.update({                          # `_target_` may be a datamodule of the user's own)
    # the in-process engine's batch cap and the post-push check (lit_rlvr.rollout.hf, lit_rlvr.rollout.lora)
    "engine.options.max_batch": at_least(1),
    "engine.options.sync_check_every": (lambda v: v >= 0, "an integer >= 0 (pushes between checks; 0 = off)"),
    "engine.options.sync_check_tol": (lambda v: v is None or v > 0, "a number > 0 (the largest log-prob gap "
                                                                    "after a push), or null"),
    # SGLang's and vLLM's in-flight pushes (lit_rlvr.rollout.segments)
    "engine.options.segment_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                                      "an integer >= 1 (new tokens per request between two chances for a push)"),
    # HFEngine's switches: OmegaConf turns any integer into a bool, so 3 passes the type check (the engine refused it
    # only once the model had loaded)
    **{f"engine.options.{k}": (lambda v: isinstance(v, bool), "true or false")
       for k in ("share_prefill", "use_cache", "process")},
    "trainer.max_steps": (lambda v: v >= 1 or v == -1, "an integer >= 1 (optimizer steps), or -1"),
    "trainer.devices": (lambda v: _devices_ok(v), "an integer >= 1, -1 (all), 'auto', or a list of device indices "
                                                  "(Lightning's `devices`)"),
    "checkpoint_every": at_least(1),
    "seed": SEED,
    "stop_grace_s": (lambda v: not isinstance(v, bool) and v >= 0, "a number of seconds >= 0 (how long a step may "
                                                                    "still run after SIGTERM or Ctrl-C)"),
    "mode": (lambda v: v in ("train", "eval"), "train or eval"),
})
# one engine call's options (`SamplingParams`): the algorithm's rows, where temperature 0 (greedy) is valid
RANGES.update({f"sampling.{k}": RANGES[f"algorithm.{k}"] for k in ("top_p", "top_k", "max_new_tokens")})
RANGES["sampling.temperature"] = RANGES["algorithm.eval_temperature"]


def _devices_ok(value: Any) -> bool:
    """Lightning's `devices`: a count >= 1, -1 (all), "auto", or device indices (a list, or "0,1"); anything else it
    refuses with a traceback once the Trainer is built (`devices=-3`: a TypeError)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1 or value == -1
    if isinstance(value, str):
        return re.fullmatch(r"auto|-1|[1-9]\d*|\d+(,\d+)*,", value.strip()) is not None or bool(
            re.fullmatch(r"\d+(,\d+)+", value.strip()))
    if isinstance(value, Sequence):
        return bool(value) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    return False


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
