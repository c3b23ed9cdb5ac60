"""`stacked_weights`: one forward of a model in which each of N row blocks runs with its own weights.

Why: C3PO generates with N weight samples. On small models each engine call costs per-token Python overhead,
not FLOPs, so N calls cost ~N times one; a single call over all N·R rows, each block of R rows with its own
weights, costs about one. Rows are N equal contiguous blocks: block n = rows [n·R, (n+1)·R).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as Fn
from torch import Tensor, nn

CONTAINERS = (nn.ParameterDict, nn.ParameterList)  # hold parameters that their parent's forward reads; never run


@contextmanager
def stacked_weights(model: nn.Module, stacks: dict[nn.Parameter, Tensor]) -> Iterator[None]:
    """Inside, every module that runs with a parameter in `stacks` (keyed by identity, so tied weights share one
    entry; value [N, *param.shape]) computes block n of its input with weights stacks[p][n].

    nn.Linear is one batched matmul, nn.Embedding one lookup into the flattened [N·V, d] stack, any other
    leaf module (norms) its own forward per block (`_looped_forward`). A parameter held in an nn.ParameterDict
    or nn.ParameterList (peft's LoRA embedding adapters) is read by the container's parent, so the parent runs
    its own forward per block: the container's forward never runs, and patching it would leave the samples
    unused. The parameters themselves are never written; the original forwards come back on exit, also on an
    exception.
    """
    sizes = {s.shape[0] for s in stacks.values()}
    if len(sizes) != 1:
        raise ValueError(f"stacked_weights: all stacks need the same number of weight sources, got {sorted(sizes)}")
    (num,) = sizes
    by_id = {id(p): s for p, s in stacks.items()}  # identity, not tensor equality
    owners = list(_owners(model, by_id))
    found = {id(holder._parameters[name]) for _, own in owners for holder, name in own}
    if len(found) != len(by_id):
        raise ValueError(f"stacked_weights: {len(by_id) - len(found)} stacked parameters are not in the model")
    patched, forwards = [], []
    try:
        for module, own in owners:
            forward = _block_forward(module, own, num)
            patched.append((module, module.__dict__.get("forward")))
            forwards.append(forward)
            module.forward = forward
        yield
        lost = [type(m).__name__ for (m, _), f in zip(patched, forwards) if m.__dict__.get("forward") is not f]
        if lost:  # the samples would have been ignored by these modules: never a silently wrong result
            raise RuntimeError(f"stacked_weights: the per-block forward of {len(lost)} module(s) ({lost[0]}, ...) was "
                               "replaced while sampling (e.g. by transformers' hub kernels on a train/eval switch: "
                               "lit_rlvr.models.without_hub_kernels); their weight samples were not used")
    finally:
        for module, instance_forward in patched:
            if instance_forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = instance_forward


Own = dict[tuple[nn.Module, str], Tensor]  # (module holding the parameter, its name there) -> stack [N, ...]


def _owners(model: nn.Module, by_id: dict[int, Tensor]) -> Iterator[tuple[nn.Module, Own]]:
    """(module to run per block, the stacked parameters it reads): its own, and its containers'."""
    for module in model.modules():
        if isinstance(module, CONTAINERS):
            continue
        holders = [module, *(c for c in module.children() if isinstance(c, CONTAINERS))]
        own = {(h, name): by_id[id(p)] for h in holders for name, p in h._parameters.items()
               if p is not None and id(p) in by_id}
        if not own:
            continue
        direct = any(h is module for h, _ in own)
        runs = [c for c in module.modules() if c is not module and not isinstance(c, CONTAINERS)]
        if direct and runs or any(id(p) in by_id for c in runs for p in c.parameters()):
            # a block's rows would be split again by a child's own per-block forward
            raise ValueError(f"stacked_weights: {type(module).__name__} reads stacked parameters and has children "
                             "that run with stacked parameters too; only one of them can run per block")
        yield module, own


def _block_forward(module: nn.Module, own: Own, num: int):
    if all(h is module for h, _ in own):
        named = {name: s for (_, name), s in own.items()}
        if isinstance(module, nn.Linear):
            return _linear_forward(module, named, num)
        if isinstance(module, nn.Embedding) and set(named) == {"weight"} and module.max_norm is None:
            table = named["weight"].reshape(-1, module.embedding_dim)  # [N·V, d]
            shifts: dict[tuple, Tensor] = {}  # per input shape: the same few shapes come back at every decode step
            return lambda ids: Fn.embedding(ids + _shift(shifts, ids, num, module.num_embeddings), table)
    return _looped_forward(module, own, num)


def _linear_forward(module: nn.Linear, own: dict[str, Tensor], num: int):
    weight, bias = own.get("weight", module.weight), own.get("bias", module.bias)
    if weight.dim() == 2:  # only the bias is stacked
        weight = weight.expand(num, *weight.shape)
    weight_t = weight.transpose(1, 2).contiguous()  # [N, in, out]: bmm runs faster on it than on a view
    if bias is not None and bias.dim() == 1:
        bias = bias.expand(num, *bias.shape)
    return lambda x: _linear(x, weight_t, bias, num)


def _linear(x: Tensor, weight_t: Tensor, bias: Tensor | None, num: int) -> Tensor:
    """x [N·R, ..., in], weight_t [N, in, out], bias [N, out] -> [N·R, ..., out]."""
    blocks = x.reshape(num, -1, x.shape[-1])  # [N, R·…, in]
    out = torch.bmm(blocks, weight_t)  # [N, R·…, out]
    if bias is not None:
        out = out + bias[:, None, :]
    return out.reshape(*x.shape[:-1], weight_t.shape[2])


def _shift(cache: dict[tuple, Tensor], ids: Tensor, num: int, vocab: int) -> Tensor:
    """n·V for the rows of block n ([N·R, 1, …], broadcast over ids [N·R, ...]): added to the ids, they index
    block n's rows of the flattened stack."""
    key = (ids.shape[0], ids.dim(), ids.device)
    if key not in cache:
        shift = torch.arange(num, device=ids.device).repeat_interleave(ids.shape[0] // num) * vocab  # [N·R]
        cache[key] = shift.view(-1, *([1] * (ids.dim() - 1)))
    return cache[key]


_BROADCAST_OK: dict[type, bool] = {}  # per class: does the row-broadcast forward match the per-block loop?


def _looped_forward(module: nn.Module, own: Own, num: int):
    """Any other module, e.g. RMSNorm: its own forward once per block with that block's weights (tensors whose
    first dim is the row count are split, everything else goes to every block). The weights are swapped in
    directly (`_swapped`): `torch.func.functional_call` costs as much per call as the norm itself.

    Why a fast path: at decode time a loop of N calls per norm costs as much as the whole rest of the forward.
    When every stacked parameter is 1-D (a norm's scale), one call with each row's weight broadcast from
    [N·R, 1, …, d] usually computes the same; the first call of each class checks it against the loop."""
    original = module.forward  # taken before the patch: the class's (or a hook's) forward
    vector = all(s.dim() == 2 for s in own.values())

    def loop(rows: int, args: tuple, kwargs: dict) -> Any:
        def block(value: Any, n: int) -> Any:
            is_rows = isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == rows
            return value.chunk(num)[n] if is_rows else value

        outs = []
        for n in range(num):
            with _swapped({key: s[n] for key, s in own.items()}):
                outs.append(original(*(block(a, n) for a in args), **{k: block(v, n) for k, v in kwargs.items()}))
        if isinstance(outs[0], Tensor):
            return torch.cat(outs)
        return type(outs[0])(torch.cat(parts) for parts in zip(*outs))

    expanded: dict[tuple[int, int], dict[str, Tensor]] = {}  # (rows, x.dim()) -> per-row weights

    def broadcast(x: Tensor, args: tuple, kwargs: dict) -> Any:
        key = (x.shape[0], x.dim())
        if key not in expanded:
            expanded[key] = {k: s.repeat_interleave(x.shape[0] // num, 0).view(x.shape[0], *[1] * (x.dim() - 2), -1)
                             for k, s in own.items()}  # [N·R, 1, …, d]
        with _swapped(expanded[key]):
            return original(*args, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        x = next(a for a in (*args, *kwargs.values()) if isinstance(a, Tensor))
        ok = _BROADCAST_OK.get(type(module))
        if not vector or ok is False:
            return loop(x.shape[0], args, kwargs)
        if ok:
            return broadcast(x, args, kwargs)
        expected = loop(x.shape[0], args, kwargs)
        try:
            got = broadcast(x, args, kwargs)
            ok = isinstance(got, Tensor) and got.shape == expected.shape and torch.allclose(got, expected)
        except Exception:  # e.g. F.layer_norm checks the weight's shape: this class needs the loop
            ok = False
        if any(not torch.equal(s[0], s[n]) for s in own.values() for n in range(1, num)):
            _BROADCAST_OK[type(module)] = ok  # equal blocks would pass any forward: no verdict from them
        return expected

    return forward


@contextmanager
def _swapped(tensors: dict[tuple[nn.Module, str], Tensor]) -> Iterator[None]:
    """Let each (holder, name) read its tensor in place of its parameter of that name (the parameters stay as
    they are)."""
    saved = {(holder, name): holder._parameters[name] for holder, name in tensors}
    for (holder, name), tensor in tensors.items():
        holder._parameters[name] = tensor
    try:
        yield
    finally:
        for (holder, name), parameter in saved.items():
            holder._parameters[name] = parameter
