"""JSON that other tools can read: a non-finite float (a metric that was not measured) is written as null."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """`obj` with every NaN or ±inf float, at any depth, replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
