"""Streaming trainer weights to a rollout engine: full tensors (gathered from FSDP2 shards), cast, bucketed."""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_rlvr.rollout.engine import RolloutEngine


def full_named_weights(model: nn.Module, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) per parameter; a DTensor shard is gathered with `full_tensor()`."""
    for name, param in model.named_parameters():
        tensor = whole(param.detach())
        yield name, tensor if dtype is None else tensor.to(dtype)


def whole(tensor: Tensor) -> Tensor:
    """`tensor` itself, or a DTensor's (FSDP2) full tensor gathered from every rank's shard: a collective."""
    if not hasattr(tensor, "full_tensor"):  # not a torch.distributed.tensor.DTensor
        return tensor
    if tensor.device.type == "cpu" and torch.cuda.is_available() and dist.get_backend() == "nccl":
        tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))  # CPU-offloaded shard
    return tensor.full_tensor()


def whole_stack(param: Tensor, stack: Tensor) -> Tensor:
    """[S, *shape] from `stack`, S tensors of this rank's shard of `param` ([S, *local shape]): `stack` itself for
    a plain parameter, else each gathered from every rank's shard as `param` is sharded (a collective)."""
    if not hasattr(param, "full_tensor"):
        return stack
    return torch.stack([whole(type(param).from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                                     stride=param.stride())) for local in stack])


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
