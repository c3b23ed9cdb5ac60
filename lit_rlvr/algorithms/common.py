"""Helpers shared by the algorithm subclasses."""

from __future__ import annotations

from typing import Any


def check_fixed(algorithm: str, **given_and_fixed: tuple[Any, Any]) -> None:
    """`key=(given, fixed)`: options that define `algorithm` and may only take the fixed value. They stay in the
    subclass signature (with the fixed value as default) so configs and the Lightning CLI show the truth; a
    different value is an error naming the key, never silently ignored."""
    for key, (given, fixed) in given_and_fixed.items():
        if given != fixed:
            raise ValueError(f"algorithm.{key}={given!r} contradicts {algorithm}, which fixes {key}={fixed!r}; "
                             f"drop the override, or use algorithm=grpo to choose {key} freely")
