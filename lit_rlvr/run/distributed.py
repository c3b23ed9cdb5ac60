"""The few collectives an RL step needs across data-parallel ranks (no-ops in a single process), and the gathers
of FSDP2 shards into full tensors (`whole`, `full_named_weights`: for the engine's weights, the LoRA adapter's
files and 3PO's weight samples).

Every rank generates for its own prompts, so per-rank quantities (metrics, token counts, the number of
micro-batches or rollout rounds) differ; these helpers make the ranks agree where FSDP needs them to run the
same collectives, and make logged metrics describe the global batch.
"""

from __future__ import annotations

import zlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

SUMMED_METRICS = frozenset({"rollouts/per_step", "rollouts/total"})  # counts: the global batch is the sum
MAX_METRICS = frozenset({"response/len_max", "mismatch/is_weight_max"})


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_gather_object(obj: object) -> list:
    """[world] every rank's picklable `obj`, in rank order (tensors in it belong on the CPU)."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank `src`'s picklable `obj` on every rank (a collective; `obj` itself in a single process)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


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


def _device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where collectives run: NCCL needs CUDA tensors, gloo takes CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(value: Tensor, op: str = "sum", group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Sum (or max) of `value` over ranks (of `group`: None = all, the default group), returned on `value`'s
    device; `value` itself is not changed."""
    if world_size() == 1:
        return value
    out = value.detach().to(_device(group), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return out.to(value.device)


def global_max(value: int, group: Optional[dist.ProcessGroup] = None) -> int:
    return int(all_reduce(torch.tensor(value, dtype=torch.long), "max", group))


def thread_group() -> Optional[dist.ProcessGroup]:
    """A gloo group of all ranks for the collectives of a second thread (async rollouts' producer): two threads
    that share one group would interleave their collectives and deadlock. None in a single process. Every rank
    must call it, in the same order."""
    return dist.new_group(backend="gloo") if world_size() > 1 else None


def reduce_metrics(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """Metrics of the global batch from each rank's metrics, in two collectives: the mean over ranks (the ranks
    hold equal numbers of prompts), the sum for `SUMMED_METRICS` and the max for `MAX_METRICS`.

    All ranks must log the same metric names in a step; a mismatch raises instead of mixing up values.
    """
    world = world_size()
    if world == 1:
        return metrics
    keys = sorted(metrics)
    key_hash = float(zlib.crc32("\n".join(keys).encode()))
    values = torch.stack([metrics[k].detach().double().cpu().reshape(()) for k in keys]
                         + [torch.tensor(key_hash, dtype=torch.float64)])
    summed = all_reduce(values)  # [K + 1]
    if summed[-1].item() != key_hash * world:
        raise RuntimeError(f"ranks logged different metric names this step (this rank: {keys})")
    maxed = all_reduce(values[:-1], "max")  # [K]
    out = {}
    for i, key in enumerate(keys):
        value = maxed[i] if key in MAX_METRICS else summed[i] if key in SUMMED_METRICS else summed[i] / world
        out[key] = value.float()
    return out


def shutdown() -> None:
    """End the process group before the interpreter exits: a process that exits with gloo's worker threads
    still alive can abort ("terminate called without an active exception"; seen in tests/test_fsdp.py)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
