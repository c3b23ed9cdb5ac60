"""`HFEngine`: in-process KV-cached sampling with a transformers causal LM (CPU or one GPU).

Modes: `shared` samples with the training module's own model (3PO perturbs it in place, nothing is copied);
`copy` keeps its own model, updated only through `load_weights` — the same path as SGLang. A `copy` engine may
hold its weights in another dtype (`dtype`, e.g. bfloat16; pushes are cast to it): an engine that computes
differently from the trainer, as SGLang and vLLM do on GPUs, on a CPU (the training-inference mismatch).

A `copy` engine also takes pushes while it generates (`push_in_flight`, `rollout.partial_rollout`): the pushed
tensors are copied aside and land between two decode steps; unfinished rows continue under the new weights, with
their KV cache kept (PipelineRL's choice: the prefix's keys and values stay those of the old weights) or computed
again with the new ones (one forward over the prefix). Each token records the tag of the push that drew it.
"""

from __future__ import annotations

import copy
import inspect
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lit_rlvr.config.bounds import model_context
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import range_problems
from lit_rlvr.config.problems import convert
from lit_rlvr.models.lora import is_lora
from lit_rlvr.rollout.batch import left_pad
from lit_rlvr.rollout.engine import Completion, InFlightPushes, RolloutEngine, SamplingParams
from lit_rlvr.rollout.kv_cache import can_select_rows, growing_cache
from lit_rlvr.rollout.lora import check_lora_sync, peft_file_name
from lit_rlvr.rollout.multi_weight import stacked_weights
from lit_rlvr.run.rng import seed_of
from lit_rlvr.run.stop import STOP

ENGINE_MODES = ("shared", "copy")


def positions(mask: Tensor) -> Tensor:
    """Position ids that skip left padding. mask [R, L] bool -> [R, L] long."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def filter_logits(logits: Tensor, *, top_k: int, top_p: float) -> Tensor:
    """Mask logits [R, V] outside the top-k / nucleus (Holtzman et al. 2020) sets with -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # [R, V]
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)  # [R, V]
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic: it copies the sign bit)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def counter_uniforms(row_seeds: Tensor, step: int | Tensor) -> Tensor:
    """A uniform in [0, 1) per row for token `step`: splitmix64 (Steele et al. 2014) of (row seed, step).

    Counter-based, so a row's draws depend on its own seed only, never on which other rows share the batch:
    the same prompt samples the same tokens on 1 rank or 8, in any batch order (`HFEngine` docstring).
    row_seeds [R] int64, step an int -> [R] float64; steps [T] long -> [R, T] (every step's draw at once, the
    same bits). int64 products wrap around, as the hash wants.
    """
    if isinstance(step, Tensor):
        z = row_seeds[:, None] + (step[None, :] + 1) * _GOLDEN  # [R, T]
    else:
        z = row_seeds + torch.full_like(row_seeds, step + 1) * _GOLDEN  # [R]
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() / float(1 << 53)


def row_seeds(prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], seed: int) -> Tensor:
    """One seed per completion from (call seed, prompt tokens, occurrence of that prompt, sample index). [R] int64."""
    seen: dict[int, int] = {}
    seeds = []
    for prompt, n in zip(prompt_token_ids, n_per_prompt):
        key = seed_of(list(prompt))
        occurrence = seen[key] = seen.get(key, -1) + 1
        seeds += [seed_of(seed, key, occurrence, j) for j in range(n)]
    return torch.tensor(seeds, dtype=torch.long) * 2654435761  # spread the 32-bit crc over 64 bits


ROW_CUT_SHRINK = 0.75  # `decoding_rows`: cut the batch once it has shrunk to this share of its rows


def decoding_rows(finished: Tensor, block: Tensor, blocks: int, shrink: float = ROW_CUT_SHRINK) -> Optional[Tensor]:
    """Which rows of a decoding batch to keep once some have finished, or None to keep them all.

    finished [A] bool, block [A] long (the weight source of each row, rows block by block). Each block keeps its
    unfinished rows, topped up with finished ones to the largest block's count (`stacked_weights` needs equal
    blocks). The batch is cut only when it shrinks to `shrink` of its size or less: a cut copies the KV cache,
    so cutting at every finished row would cost more than the decoding it saves (at most log_{1/shrink}(A) cuts).
    Returns [A'] positions in increasing order."""
    counts = torch.bincount(block[~finished], minlength=blocks)  # [blocks] unfinished rows per block
    per_block = int(counts.max())
    if per_block * blocks > shrink * len(finished):
        return None
    # per block: unfinished rows first, then finished ones, each in order; take the first `per_block`
    rank = block * 2 * len(finished) + finished.long() * len(finished) + torch.arange(len(finished))
    order = torch.sort(rank).indices  # [A]
    first = torch.searchsorted(block[order], torch.arange(blocks))  # [blocks] where each block starts in `order`
    take = (first[:, None] + torch.arange(per_block)).flatten()  # [blocks · per_block]
    return torch.sort(order[take]).values


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode while it samples (a `shared` engine's model is the trainer's, in train mode: LoRA
    dropout must not act on sampling); each module's own mode comes back on exit."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _engine_dtype(dtype: Optional[str], model: nn.Module, mode: str) -> torch.dtype:
    """The dtype of the engine's weights: `dtype` (a torch dtype name), else the policy's."""
    policy = next(model.parameters()).dtype
    if dtype is None:
        return policy
    own = getattr(torch, str(dtype), None)
    if not isinstance(own, torch.dtype) or not own.is_floating_point:
        raise ValueError(f"engine.options.dtype={dtype!r} is not a floating torch dtype (e.g. bfloat16, float32); "
                         "null = the policy's")
    if mode == "shared" and own != policy:
        raise ValueError(f"engine.options.dtype={dtype} needs engine.options.mode=copy: a shared engine samples with "
                         f"the trainer's own {str(policy).removeprefix('torch.')} weights")
    return own


def _per_prompt(done: list[Completion], n_per_prompt: Sequence[int]) -> list[list[Completion]]:
    """Flat completions, prompt after prompt -> [B] lists."""
    out: list[list[Completion]] = []
    start = 0
    for n in n_per_prompt:
        out.append(done[start : start + n])
        start += n
    return out


@dataclass
class _Staged:
    """A push made while a generation runs (`HFEngine.push_in_flight`): its tag and copies of what it loads."""

    tag: int
    recompute_kv: bool
    thread: int  # the pushing thread (its loads are staged; others' are not)
    weights: dict[str, Tensor] = field(default_factory=dict)
    adapter: Optional[tuple[str, dict[str, Tensor]]] = None

    def after(self, earlier: Optional["_Staged"]) -> "_Staged":
        """This push on top of an earlier one not landed yet: its tensors win, the earlier's others stay."""
        if earlier is None:
            return self
        return _Staged(self.tag, self.recompute_kv or earlier.recompute_kv, self.thread,
                       {**earlier.weights, **self.weights}, self.adapter or earlier.adapter)


class HFEngine(InFlightPushes, RolloutEngine):
    """Batched sampling with a transformers model; see the module docstring for the two modes.

    Sampling is batch-invariant: completion j of a prompt draws its tokens by inverse-CDF sampling from
    counter-based uniforms keyed by (seed, prompt, j), so it does not depend on the batch it shares or the
    rank it runs on (a 2-rank run samples what a 1-rank run with the same global batch samples).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_id: int,
        eos_id: int,
        mode: Optional[str] = None,
        use_cache: bool = True,
        max_batch: int = 256,
        bucket_bytes: int = 256 << 20,
        share_prefill: bool = True,
        lora_sync: str = "adapter",
        dtype: Optional[str] = None,
    ):
        mode = mode or "shared"  # (null: the module's choice, `shared` unless rollouts are asynchronous)
        if mode not in ENGINE_MODES:
            raise ValueError(f"engine.options.mode={mode!r} is not valid; valid: {', '.join(ENGINE_MODES)}")
        # before any copy of the model: a bad value is one line naming its key
        self._use_cache = convert("engine.options.use_cache", use_cache, bool)
        self._max_batch = convert("engine.options.max_batch", max_batch, int)
        problems = range_problems({"max_batch": self._max_batch}, "engine.options")  # 0 would loop on no rows
        ConfigError.check(problems)
        # one prompt prefill per distinct prompt, its cache rows repeated
        self._share_prefill = convert("engine.options.share_prefill", share_prefill, bool)
        self.bucket_bytes = convert("engine.options.bucket_bytes", bucket_bytes, int)  # one weight push's cap (copy)
        own_dtype = _engine_dtype(dtype, model, mode)
        self._mode = mode
        self.lora_sync = check_lora_sync(lora_sync)
        self.shares_weights = self.can_generate_stacked = mode == "shared"
        self.model = model if mode == "shared" else copy.deepcopy(model).to(own_dtype)
        if mode == "copy" and is_lora(model):
            if lora_sync == "merged":  # a plain transformers model, as a server without LoRA holds it
                self.model = self.model.merge_and_unload()
            else:  # its own copy of the peft model: the base stays as copied, adapters arrive by push
                self.serves_lora = True
                self.adapter_base_by_name = False
        if mode == "copy":
            self.model.requires_grad_(False)
            self.weight_dtype = own_dtype if dtype is not None else None  # pushes are cast to it
        self._pad_id, self._eos_id = pad_id, eos_id
        self._active_adapter: Optional[str] = None  # the adapter loaded last: `copy` mode holds one at a time
        self._params = dict(self.model.named_parameters())
        # transformers >= 5.x names the KV cache argument `cache`; older releases `past_key_values`
        # (a peft wrapper's forward takes **kwargs: ask the transformers model under it)
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self._cache_arg = "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
        # pushes while generating (`push_in_flight`): the trainer's thread stages, the generating thread lands them
        self.swaps_in_flight = mode == "copy"
        self._init_in_flight()
        self._staged: Optional[_Staged] = None  # pushes waiting for the next decode step, merged
        self._superseded: set[str] = set()  # adapters replaced by a tagged push: a plan made before may name one

    # -- weights ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        if self._mode == "shared":
            return  # the engine samples with the trainer's own tensors
        if self._stages_here():  # the trainer goes on changing its tensors: copies land later
            self._staging.weights.update((name, t.detach().clone()) for name, t in named_tensors)
            return
        self._load(named_tensors)

    def _load(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        for name, tensor in named_tensors:
            target = self._params.get(name)
            if target is None:
                raise KeyError(f"HFEngine.load_weights: unknown parameter {name!r}")
            target.copy_(tensor)

    @torch.no_grad()
    def load_adapter(self, name: str, tensors: dict[str, Tensor], config: dict, activate: bool = True) -> None:
        """`copy` mode with `lora_sync=adapter`: one adapter slot, overwritten in place by each push."""
        if not self.serves_lora:
            raise RuntimeError("HFEngine serves adapters only in copy mode with a LoRA policy and lora_sync=adapter")
        slots = self._adapter_slots()
        if set(tensors) != set(slots):
            raise KeyError(f"HFEngine.load_adapter({name!r}): {len(set(slots) - set(tensors))} adapter tensors "
                           f"missing, {len(set(tensors) - set(slots))} unknown")
        if self._stages_here():
            self._staging.adapter = (name, {k: t.detach().clone() for k, t in tensors.items()})
            return
        self._set_adapter(name, tensors)

    def _adapter_slots(self) -> dict[str, Tensor]:
        return {peft_file_name(n): p for n, p in self._params.items() if ".lora_" in n}

    def _set_adapter(self, name: str, tensors: dict[str, Tensor]) -> None:
        slots = self._adapter_slots()
        for key, tensor in tensors.items():
            slots[key].copy_(tensor)
        if self._tag is not None and self._active_adapter is not None:
            self._superseded.add(self._active_adapter)
        self._active_adapter = name

    def _check_adapter(self, params: SamplingParams) -> None:
        if params.adapter not in (None, self._active_adapter, *self._superseded):
            raise RuntimeError(f"HFEngine holds adapter {self._active_adapter!r}, asked for {params.adapter!r}")

    # -- pushes while generating -------------------------------------------------------------------------------
    def push_in_flight(self, tag: int, *, recompute_kv: bool = False) -> AbstractContextManager:
        if not self.swaps_in_flight:
            raise RuntimeError("HFEngine takes pushes while generating in copy mode only (a shared engine's weights "
                               "are the trainer's)")
        return super().push_in_flight(tag, recompute_kv=recompute_kv)

    def _new_staging(self, tag: int, recompute_kv: bool, thread: int) -> _Staged:
        return _Staged(tag, recompute_kv, thread)

    def _add_staged(self, staging: _Staged) -> None:
        """One staged push at most: a newer one replaces what it loads anew (one copy of the weights)."""
        self._staged = staging.after(self._staged)

    def _land_staged(self) -> Optional[bool]:
        """Load the push staged since the last call (None: there was none; else whether it asks for the KV cache
        to be computed again). Called by the generating thread between steps, before a generation, and by a direct
        push (no generation runs then)."""
        with self._swap:
            staged, self._staged = self._staged, None
        if staged is None:
            return None
        self._load(staged.weights.items())
        if staged.adapter is not None:
            self._set_adapter(*staged.adapter)
        self._tag = staged.tag
        return staged.recompute_kv

    def to(self, device: torch.device) -> "HFEngine":
        """Move a `copy` engine's model (a `shared` one moves with the trainer's model)."""
        if self._mode == "copy":
            self.model.to(device)
        return self

    # -- sampling --------------------------------------------------------------------------------------------
    # inference_mode, not no_grad: no version counters or view tracking on the KV cache and logits (less per-op
    # work); what leaves the engine is only read by the trainer (packing copies it into ordinary tensors)
    @torch.inference_mode()
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams
    ) -> list[list[Completion]]:
        rows = [list(p) for p, n in zip(prompt_token_ids, n_per_prompt) for _ in range(n)]
        seeds = row_seeds(prompt_token_ids, n_per_prompt, params.seed)  # [R]
        done: list[Completion] = []
        with self._generation(), eval_mode(self.model):
            self._check_adapter(params)
            for start in range(0, len(rows), self._max_batch):
                done.extend(self._sample(rows[start : start + self._max_batch], params,
                                         seeds[start : start + self._max_batch]))
        return _per_prompt(done, n_per_prompt)

    @torch.inference_mode()
    def generate_stacked(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        counts_per_source: list[list[int]],
        params_per_source: list[SamplingParams],
        stacks: dict[nn.Parameter, Tensor],
    ) -> list[list[list[Completion]]]:
        """What S calls `generate(prompt_token_ids, counts_per_source[s], params_per_source[s])` would give with
        weights stacks[·][s] in the model, in one batched call (`multi_weight.stacked_weights`; `shared` mode).
        Returns [S][B] lists of completions.

        Rows are laid out source by source and keep their own source's seeds, so each completion equals its
        separate-call twin up to the float rounding of a batched matmul. Every source needs the same total
        count (equal row blocks) and the same sampling params but the seed.
        """
        if self._mode != "shared":
            raise RuntimeError("HFEngine.generate_stacked samples with the trainer's model: engine.mode must be shared")
        num = len(counts_per_source)
        per_source = sum(counts_per_source[0])
        if any(sum(c) != per_source for c in counts_per_source):
            raise ValueError(f"generate_stacked: sources need equal totals, got {[sum(c) for c in counts_per_source]}")
        if len({replace(p, seed=0) for p in params_per_source}) != 1:
            raise ValueError("generate_stacked: sampling params may differ only in the seed")
        rows = [[list(p) for p, n in zip(prompt_token_ids, counts) for _ in range(n)] for counts in counts_per_source]
        seeds = [row_seeds(prompt_token_ids, c, p.seed) for c, p in zip(counts_per_source, params_per_source)]
        done: list[list[Completion]] = [[] for _ in range(num)]
        window = max(1, self._max_batch // num)  # rows per source per batch: blocks stay equal
        with self._generation(), stacked_weights(self.model, stacks), eval_mode(self.model):
            for start in range(0, per_source, window):
                batch = [r for block in rows for r in block[start : start + window]]
                block_seeds = torch.cat([s[start : start + window] for s in seeds])
                out = self._sample(batch, params_per_source[0], block_seeds, blocks=num)
                size = len(out) // num
                for s in range(num):
                    done[s].extend(out[s * size : (s + 1) * size])
        return [_per_prompt(d, counts) for d, counts in zip(done, counts_per_source)]

    def _forward(self, ids: Tensor, mask: Tensor, cache=None, last: int = 1, position_ids: Optional[Tensor] = None):
        """(logits [R, V] of the last position, cache). `position_ids` [R, n]: those of `ids` when the caller
        knows them (a decode step), else counted from `mask`."""
        device = next(self.model.parameters()).device
        position_ids = positions(mask)[:, -ids.shape[1] :] if position_ids is None else position_ids
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=position_ids.to(device),
            use_cache=self._use_cache,
            logits_to_keep=last,
            **({self._cache_arg: cache} if cache is not None else {}),
        )
        return out.logits[:, -1].float().cpu(), getattr(out, self._cache_arg, None)  # [R, V]

    def _prefill(self, rows: list[list[int]], blocks: int, room: int) -> tuple[Tensor, Tensor, Tensor, object]:
        """(ids [R, P], mask [R, P], logits [R, V] after each prompt, KV cache of all rows; `room`: the most
        positions still to come, which the cache grows towards).

        Rows form `blocks` equal contiguous blocks (`stacked_weights` runs block n with weight source n; 1
        block otherwise). With `share_prefill`, each distinct prompt of a block runs once and its cache row is
        repeated: a group's G samples share one prefill. Blocks stay equal: a block with fewer distinct
        prompts repeats its first one."""
        size = len(rows) // blocks
        uniques, inverses = [], []
        for start in range(0, len(rows), size):
            index_of: dict[tuple[int, ...], int] = {}
            inverses.append([index_of.setdefault(tuple(r), len(index_of)) for r in rows[start : start + size]])
            uniques.append(list(index_of))
        width = max(len(u) for u in uniques)
        cache = growing_cache(self.model.config, room) if self._use_cache else None
        if not self._share_prefill or width == size or not can_select_rows(cache):  # each row its own prefill
            ids, mask = left_pad(rows, self._pad_id)
            return (ids, mask, *self._forward(ids, mask, cache))
        padded = [row for u in uniques for row in u + u[:1] * (width - len(u))]  # blocks·width distinct prompts
        ids, mask = left_pad(padded, self._pad_id)  # [blocks·width, P]
        logits, cache = self._forward(ids, mask, cache)
        index = torch.tensor([n * width + i for n, inverse in enumerate(inverses) for i in inverse])  # [R]
        if cache is not None:
            cache.batch_select_indices(index.to(next(self.model.parameters()).device))
        return ids[index], mask[index], logits[index], cache

    def _sample(self, rows: list[list[int]], params: SamplingParams, seeds: Tensor,
                blocks: int = 1) -> list[Completion]:
        """Decode `rows` token by token. Per step only what must be per step (every draw's uniform is made up
        front; a finished row keeps decoding until a row cut drops it, its tokens past the stop unread); lengths
        and finish reasons come from each row's first stop token at the end."""
        num_rows, steps = len(rows), params.max_new_tokens
        context = model_context(self.model)
        if context is not None:  # every row ends by the model's last position ("length"), never past it
            steps = max(1, min(steps, context - max(len(r) for r in rows)))
        stop = torch.tensor([] if params.ignore_eos else sorted({self._eos_id, *params.stop_token_ids}),
                            dtype=torch.long)
        # an environment's stop strings, as token sequences: a row also stops where one of them ends
        sequences = [] if params.ignore_eos else [torch.tensor(q, dtype=torch.long) for q in params.stop_sequences if q]
        tokens = torch.full((num_rows, steps), self._pad_id, dtype=torch.long)  # [R, T]
        logprobs = torch.zeros((num_rows, steps))  # [R, T]
        ids, mask, logits, cache = self._prefill(rows, blocks, steps)  # [R, P], [R, P], [R, V]
        width = mask.shape[1]
        position = mask.sum(-1)  # [R]: the first decoded token's position (left padding skipped)
        mask = torch.cat([mask, torch.ones((num_rows, steps), dtype=torch.bool)], dim=1)  # [R, P+T]: step t, P+t+1
        uniforms = counter_uniforms(seeds, torch.arange(steps))  # [R, T]
        # [R, T] the tag of the weights whose logits drew each token (-1: before the first tagged push)
        versions = torch.full((num_rows, steps), -1 if self._tag is None else self._tag, dtype=torch.long)
        live = torch.arange(num_rows)  # [A] the rows that ids, mask, logits and the cache hold, in their order
        done = torch.zeros(num_rows, dtype=torch.bool)  # [A]
        cut = can_select_rows(cache)  # e.g. a linear-attention layer's state cannot drop rows
        for t in range(steps):
            STOP.check()  # a stop request past its grace abandons a long decode too
            token, logp = self._pick(logits, params, uniforms[:, t])  # [A], [A]
            tokens[live, t], logprobs[live, t] = token, logp
            done |= torch.isin(token, stop)
            for q in sequences:
                if t + 1 >= len(q):
                    done |= (tokens[live, t + 1 - len(q) : t + 1] == q).all(-1)
            unfinished = int((~done).sum())  # the step's one sync
            if unfinished == 0 or t + 1 == steps:
                break
            # decoding_rows keeps every row while more than `shrink` of them are unfinished: no call needed then
            shrink = ROW_CUT_SHRINK
            keep = (decoding_rows(done, live // (num_rows // blocks), blocks, shrink)
                    if cut and unfinished <= shrink * len(live) else None)  # [A']
            if keep is not None:  # drop finished rows from the batch: they would be decoded for nothing
                live, token, done, uniforms, position, mask, ids = (
                    x[keep] for x in (live, token, done, uniforms, position, mask, ids))
                if cache is not None:
                    cache.batch_select_indices(keep.to(next(self.model.parameters()).device))
            recompute = self._land_staged() if self._staged is not None else None  # a push in flight lands here
            if recompute is not None:
                versions[live, t + 1 :] = self._tag
            if self._use_cache and recompute:  # the prefix's KV cache again, with the new weights
                prefix = torch.cat([ids, tokens[live, : t + 1]], dim=1)  # [A, P+t+1]
                logits, cache = self._forward(prefix, mask[:, : width + t + 1],
                                              growing_cache(self.model.config, steps - t - 1))
            elif self._use_cache:
                logits, cache = self._forward(token[:, None], mask[:, : width + t + 1], cache,
                                              position_ids=(position + t)[:, None])
            else:
                ids = torch.cat([ids, token[:, None]], dim=1)
                logits, _ = self._forward(ids, mask[:, : width + t + 1])
        return self._completions(tokens, logprobs, stop, sequences, versions if self._tag is not None else None)

    @staticmethod
    def _completions(tokens: Tensor, logprobs: Tensor, stop: Tensor, sequences: Sequence[Tensor] = (),
                     versions: Optional[Tensor] = None) -> list[Completion]:
        """Each row up to and including its first stop token or the end of its first stop sequence ("stop"), or
        all of it ("length"); `versions` [R, T]: each token's weights' tag (None: untagged)."""
        is_stop = torch.isin(tokens, stop)  # [R, T]
        for q in sequences:
            if len(q) <= tokens.shape[1]:  # the window starting at i ends at i + len(q) - 1
                is_stop[:, len(q) - 1 :] |= (tokens.unfold(1, len(q), 1) == q).all(-1)
        finished = is_stop.any(-1)  # [R]
        lengths = torch.where(finished, is_stop.int().argmax(-1) + 1, tokens.shape[1])  # argmax: the first stop
        return [Completion(tokens[r, :n], logprobs[r, :n], "stop" if f else "length",
                           versions=None if versions is None else versions[r, :n])
                for r, (n, f) in enumerate(zip(lengths.tolist(), finished.tolist()))]

    @staticmethod
    def _pick(logits: Tensor, params: SamplingParams, uniforms: Tensor) -> tuple[Tensor, Tensor]:
        """Sample one token per row (inverse CDF at `uniforms` [R]); its behaviour log-prob is under
        softmax(logits / T) (greedy: T = 1)."""
        if params.temperature == 0:
            token = logits.argmax(-1)  # [R]
            return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
        scaled = logits / params.temperature  # [R, V]
        probs = torch.softmax(filter_logits(scaled, top_k=params.top_k, top_p=params.top_p), dim=-1)
        cdf = probs.double().cumsum(-1)  # [R, V]
        # [R]; p = 0 never drawn
        token = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
        token = token.clamp_max(probs.shape[-1] - 1)
        return token, torch.log_softmax(scaled, -1).gather(-1, token[:, None]).squeeze(-1)
