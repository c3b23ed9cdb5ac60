"""Seeds derived from keys (`seed_of`), and the global RNG states (python, numpy, torch CPU and CUDA) for a
checkpoint, which Lightning does not save."""

from __future__ import annotations

import random
import zlib
from typing import Any

import numpy as np
import torch


def seed_of(*parts: object) -> int:
    """A 32-bit seed that is a function of `parts` only (e.g. run seed, step, round, weight source): the same
    key gives the same seed on any machine, rank or resume. CRC-32 of the parts joined by ':'."""
    return zlib.crc32(":".join(str(p) for p in parts).encode())


def rng_states() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # plain types and tensors only, so checkpoints load with torch.load(weights_only=True) (Lightning's default)
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    states = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
