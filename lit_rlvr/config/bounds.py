"""The bounds of one rollout against the model's context (docs/architecture.md §10), in one place.

A sequence the trainer runs and the engine decodes is a prompt plus a response: at most `algorithm.max_new_tokens`
response tokens single-turn, `env.max_tokens` (model and observation tokens together) with an environment; an
evaluation samples with the same budgets. The response budget must leave room for a prompt in the model's
positions, and a prompt limit (`data.max_prompt_tokens`) plus the budget must fit them. Past its positions a model
does not fail: it decodes on with meaningless positions, and memory and time grow with the budget (100000
tokens of the 256-position tiny model ran 15 minutes and 4 GB without ending a step).

The data may declare the tokens its completions need (`data.answer_tokens`): a smaller budget is refused
(`answer_budget_problems`), by train.py before any work and by the datamodule's setup on every entry point.

Checked where the context is first known: by train.py before any work when the model declares it without being
loaded (the built-in model, a local directory's config.json), else by the module's constructor right after the
model loads (every entry point), before engines, data or warm-up work. The data's prompt check
(`lit_rlvr.data.lengths.token_limit`) and the multi-turn loop's room per rollout use the same limit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import problem_line

TINY_CONTEXT = 256  # the built-in tiny model's positions (lit_rlvr.models.tiny.tiny_config)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")  # what HF configs call it
SANE_TOKENIZER_LIMIT = 10**8  # tokenizers without a limit declare a huge sentinel (1e30) as model_max_length


def config_context(config: Any) -> Optional[int]:
    """The positions an HF config (object or dict) declares, or None."""
    for key in CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_context(model: Any, tokenizer: Any = None) -> Optional[int]:
    """A loaded model's positions: its config's, or its tokenizer's `model_max_length` when smaller or alone."""
    limits = [config_context(getattr(model, "config", None))]
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < SANE_TOKENIZER_LIMIT:
        limits.append(declared)
    known = [n for n in limits if n is not None]
    return min(known) if known else None


def declared_context(name_or_path: Any) -> Optional[int]:
    """The positions of `model.name_or_path` known without loading it: the built-in model's, or a local HF
    directory's config.json; None otherwise (a hub name: checked once the model has loaded)."""
    if name_or_path == "tiny":
        return TINY_CONTEXT
    path = Path(str(name_or_path)).expanduser() / "config.json"
    try:
        return config_context(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def response_budget(max_new_tokens: int, env_max_tokens: Optional[int]) -> tuple[int, str]:
    """(most response tokens of one rollout, the key that sets it): `env.max_tokens` with an environment."""
    if env_max_tokens is not None:
        return int(env_max_tokens), "env.max_tokens"
    return int(max_new_tokens), "algorithm.max_new_tokens"


def bound_problems(context: int, *, max_new_tokens: Any, env_max_tokens: Any = None,
                   max_prompt_tokens: Any = None) -> list[str]:
    """One line per bound of a rollout that does not fit `context` positions (values of a wrong type are the
    range checks' business and skipped here)."""
    where = f"the model has {context} positions, and a prompt needs at least one"
    problems = []
    for key, value in (("algorithm.max_new_tokens", max_new_tokens), ("env.max_tokens", env_max_tokens)):
        if _integer(value) and value >= context:
            problems.append(problem_line(key, value, f"an integer < {context} ({where})"))
    if _integer(max_prompt_tokens) and not problems and _integer(max_new_tokens):
        budget, key = response_budget(max_new_tokens, env_max_tokens if _integer(env_max_tokens) else None)
        if max_prompt_tokens + budget > context:
            problems.append(problem_line("data.max_prompt_tokens", max_prompt_tokens,
                                         f"an integer <= {context - budget} (the model's {context} positions minus "
                                         f"{key}={budget}), or null"))
    return problems


def answer_budget_problems(budget: Any, budget_key: str, answer_tokens: Any) -> list[str]:
    """A response budget (`budget_key`: algorithm.max_new_tokens, or env.max_tokens with an environment) below the
    tokens the data says its completions need (`data.answer_tokens`): they would be cut before their answer and
    score malformed. One line; values of a wrong type are the range checks' business."""
    if not (_integer(budget) and _integer(answer_tokens)) or budget >= answer_tokens:
        return []
    return [problem_line(budget_key, budget, f"an integer >= {answer_tokens} (data.answer_tokens: this data's "
                                             "completions need about that many tokens, and shorter ones are cut "
                                             "before their answer)")]


def check_bounds(context: Optional[int], **bounds: Any) -> None:
    """`bound_problems` as a `ConfigError` (nothing to check when the context is unknown)."""
    problems = bound_problems(context, **bounds) if context is not None else []
    ConfigError.check(problems)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
