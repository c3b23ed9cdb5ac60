"""The reward's settings, checked before any work (train.py's config check, the module's constructor): one line
per problem, naming the key. Torch-free, like the rest of what reward worker processes import."""

from __future__ import annotations

import inspect
from typing import Any

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.config.problems import problem_line  # noqa: F401 (the rewards' one-line shape, torch-free)


def is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def constructor_problems(cls: type, options: dict[str, Any]) -> list[str]:
    """The lines a reward class's own checks raise for `options` (those it takes), without keeping the object."""
    params = inspect.signature(cls).parameters
    try:
        cls(**{k: v for k, v in options.items() if k in params})
    except RewardOptionError as err:
        return list(err.problems)
    return []
