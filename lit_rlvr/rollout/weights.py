"""Streaming trainer weights to a rollout engine: full tensors (gathered from FSDP2 shards by
`lit_rlvr.run.distributed.full_named_weights`), cast, bucketed."""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from lit_rlvr.rollout.engine import RolloutEngine
from lit_rlvr.run.distributed import full_named_weights


def buckets(named: Iterator[tuple[str, Tensor]], max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group tensors into lists of at most `max_bytes` (a tensor larger than the cap travels alone)."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def push_named(engine: RolloutEngine, named: Iterator[tuple[str, Tensor]], bucket_bytes: int) -> int:
    """Send (HF name, tensor) pairs to `engine.load_weights` in buckets of at most `bucket_bytes`, then
    `engine.end_weight_update` (SGLang flushes its cache once there); returns the bytes pushed."""
    pushed = 0
    for bucket in buckets(named, bucket_bytes):
        engine.load_weights(bucket)
        pushed += sum(t.numel() * t.element_size() for _, t in bucket)
    engine.end_weight_update()
    return pushed


def push_weights(engine: RolloutEngine, model: nn.Module, *, bucket_bytes: int = 256 << 20,
                 dtype: Optional[torch.dtype] = None) -> int:
    """Send all the model's weights to the engine (`push_named`); returns the bytes pushed."""
    return push_named(engine, full_named_weights(model, dtype), bucket_bytes)
