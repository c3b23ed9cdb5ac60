"""Pushes that land while a request-serving engine generates (SGLang, vLLM; `rollout.partial_rollout=true`).

Such an engine takes a batch of requests and returns when the last one ends, so a push cannot land between two of
its decode steps as in `HFEngine`. It generates in segments instead: each unfinished completion asks for at most
`segment_tokens` new tokens per call, and between two calls a push staged by another thread lands. A completion
then goes on as a new request whose prompt is its prompt and its tokens so far, which the engine computes again
with the weights it holds now: the KV cache at a swap is recomputed (`rollout.kv_at_swap=recompute`), the only
choice such an engine offers, since the new weights must not read keys and values it no longer holds. This is
AReaL's interruptible generation (abort, push, resubmit with the tokens so far) with the interruption at fixed
points; between two segments without a push, the prefix cache (SGLang's radix cache, vLLM's prefix caching)
serves the prefix again.

Continuing a completion under the same weights draws from the same distribution as one long request, so a segment
boundary changes the random stream, not what is sampled: segment 0 uses the call's seed (with `segment_tokens` ≥
`max_new_tokens` the generation is the unsegmented one), segment k a seed derived from (seed, k).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from lit_rlvr.config.options import range_problems
from lit_rlvr.rollout.engine import Completion, InFlightPushes, SamplingParams

GenerateOnce = Callable[[Sequence[Sequence[int]], Sequence[int], SamplingParams], list[list[Completion]]]


def segment_seed(seed: int, segment: int) -> int:
    """The seed of segment `segment` of a call seeded `seed`: the seed itself for the first, then a hash."""
    if segment == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{segment}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def generate_in_segments(generate_once: GenerateOnce, prompt_token_ids: Sequence[Sequence[int]],
                         n_per_prompt: Sequence[int], params: SamplingParams, segment_tokens: int,
                         between: Callable[[], int], eos_id: Optional[int]) -> list[list[Completion]]:
    """`n_per_prompt[b]` completions of prompt b, generated `segment_tokens` new tokens at a time.

    `generate_once(prompts, counts, params)` is one call of the engine; `between()` runs before each segment (it
    lands a staged push) and returns the tag of the weights the segment runs with, which each of its tokens records
    in `Completion.versions`. A completion ends when a segment stops it, or ends short of its budget (the engine's
    own limit, e.g. its context), or it holds `params.max_new_tokens` tokens; its log-probs are those of the weights
    that drew each token. SGLang and vLLM check the length before the stop tokens, so a segment whose last token is
    a stop token (`eos_id` or `params.stop_token_ids`, none with `ignore_eos`) says "length": it is a stop here.
    """
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens={segment_tokens!r} must be at least 1")
    stops = set() if params.ignore_eos else {*params.stop_token_ids, *([] if eos_id is None else [eos_id])}
    rows = [[int(t) for t in prompt] for prompt, n in zip(prompt_token_ids, n_per_prompt) for _ in range(n)]
    parts: list[list[tuple[Completion, int]]] = [[] for _ in rows]
    active, done_tokens, segment = list(range(len(rows))), 0, 0
    while active:
        tag = between()
        budget = min(segment_tokens, params.max_new_tokens - done_tokens)
        seg_params = replace(params, max_new_tokens=budget, seed=segment_seed(params.seed, segment))
        if segment == 0:  # the call as asked: its first tokens are those of the unsegmented generation
            outputs = [c for per_prompt in generate_once(prompt_token_ids, n_per_prompt, seg_params)
                       for c in per_prompt]
        else:  # each unfinished completion as a prompt of its own: its prompt and its tokens so far
            prompts = [rows[i] + [t for c, _ in parts[i] for t in c.token_ids.tolist()] for i in active]
            outputs = [c for (c,) in generate_once(prompts, [1] * len(active), seg_params)]
        done_tokens += budget
        still = []
        for i, completion in zip(active, outputs, strict=True):
            parts[i].append((completion, tag))
            if completion.finish_reason != "length" or done_tokens >= params.max_new_tokens:
                continue
            if len(completion.token_ids) and int(completion.token_ids[-1]) in stops:
                completion.finish_reason = "stop"  # a stop token drawn as the segment's last token
            elif len(completion.token_ids) == budget:
                still.append(i)
        active, segment = still, segment + 1
    joined = iter([_join(p) for p in parts])
    return [[next(joined) for _ in range(n)] for n in n_per_prompt]


def _join(parts: list[tuple[Completion, int]]) -> Completion:
    """One completion from its segments, each token tagged with its segment's weights."""
    return Completion(torch.cat([c.token_ids for c, _ in parts]), torch.cat([c.logprobs for c, _ in parts]),
                      parts[-1][0].finish_reason,
                      versions=torch.cat([torch.full((len(c.token_ids),), tag, dtype=torch.long)
                                          for c, tag in parts]))


def _cpu_copy(value: Any) -> Any:
    """`value` with every tensor in it copied to the CPU (an iterator of (name, tensor) pairs becomes a list)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_cpu_copy(v) for v in value)
    if isinstance(value, (list, Iterator)):
        return [_cpu_copy(v) for v in value]
    return value


@dataclass
class _Staged:
    """The engine calls of a push made while a generation runs, with copies of their tensors, in order."""

    tag: int
    thread: int  # the pushing thread (its calls are staged; others' are not)
    calls: list[tuple[str, tuple]] = field(default_factory=list)


class SegmentedPushes(InFlightPushes):
    """`push_in_flight` for a request-serving engine (a mixin of `RolloutEngine`): while a generation runs, the
    pushing thread's `load_weights`, `load_adapter` and `end_weight_update` calls are copied aside and made by the
    generating thread between two segments (`generate_in_segments`). An engine calls `_init_segments` when built;
    each of those three methods first offers its call to `_staged_call`; it generates through
    `_generate_with_pushes`. The KV cache of an unfinished completion is always computed again (its prefix is a new
    request's prompt), whatever a push's `recompute_kv` says."""

    def _init_segments(self, segment_tokens: int, eos_id: Optional[int]) -> None:
        problems = range_problems({"segment_tokens": segment_tokens}, "engine.options")
        if problems:
            raise ValueError(problems[0])
        self._segment_tokens, self._eos_id = segment_tokens, eos_id
        self.swaps_in_flight = True
        self._init_in_flight()
        self._staged: list[_Staged] = []  # pushes waiting for the next segment, in order

    def _new_staging(self, tag: int, recompute_kv: bool, thread: int) -> _Staged:
        return _Staged(tag, thread)

    def _add_staged(self, staging: _Staged) -> None:
        self._staged.append(staging)  # each a copy: pushes rarely stage twice within one segment

    def _staged_call(self, method: str, *args: Any) -> bool:
        """True when this thread's push is staged: the call `method(*args)` is kept for the next segment, with CPU
        copies of its tensors (the trainer goes on changing its own)."""
        if not self._stages_here():
            return False
        self._staging.calls.append((method, tuple(_cpu_copy(a) for a in args)))
        return True

    def _land_staged(self) -> Optional[int]:
        """Make the calls of the pushes staged so far, in order; returns the tag of the weights held now."""
        with self._swap:
            staged, self._staged = self._staged, []
        for push in staged:
            for method, args in push.calls:
                getattr(self, method)(*args)
            self._tag = push.tag
        return self._tag

    def _generate_with_pushes(self, generate_once: GenerateOnce, prompt_token_ids: Sequence[Sequence[int]],
                              n_per_prompt: Sequence[int], params: SamplingParams) -> list[list[Completion]]:
        """Whole requests until the first tagged push (`rollout.partial_rollout=false` never makes one), and in the
        pushing thread (an evaluation, the post-push check: no push can come while it generates); otherwise
        segments, with staged pushes landing between them. A generation waits for a push landing at once."""
        if self._tag is None:
            return generate_once(prompt_token_ids, n_per_prompt, params)
        with self._generation():
            if threading.get_ident() == self._pusher:
                return generate_once(prompt_token_ids, n_per_prompt, params)
            return generate_in_segments(generate_once, prompt_token_ids, n_per_prompt, params, self._segment_tokens,
                                        self._land_staged, self._eos_id)
