"""Helpers shared by the algorithm subclasses."""

from __future__ import annotations

from typing import Any


def pin_options(algorithm: str, kwargs: dict[str, Any], **fixed: Any) -> None:
    """Set, in `kwargs` (in place, before `super().__init__(**kwargs)`), the base-module options that define
    `algorithm`. A user value that differs is an error naming the key: an option is never silently ignored."""
    for key, value in fixed.items():
        if key in kwargs and kwargs[key] != value:
            raise ValueError(f"algorithm.{key}={kwargs[key]!r} contradicts {algorithm}, which fixes {key}={value!r}; "
                             f"drop the override, or use algorithm=grpo to choose {key} freely")
        kwargs[key] = value
