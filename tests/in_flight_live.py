"""A push that lands while a live engine (vLLM, SGLang) generates (`lit_rlvr.rollout.segments`), against HFEngine
doing the same in segments, shared by tests/test_vllm_live.py and tests/live_sglang/: greedy, so token for token.

The push is made from another thread, as the trainer makes it, right after the engine's first segment returns: the
engine is generating then, so the push is staged, and it lands before the second segment."""

from __future__ import annotations

import copy
import threading

import torch

from lit_rlvr.rollout.engine import SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.segments import generate_in_segments
from lit_rlvr.rollout.weights import push_weights

PROMPTS = ["12+34=", "5+5=", "71-18=", "3*4="]
SEGMENT = 4
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)  # segments of 4, 4 and 2 tokens


def perturbed(model, scale: float = 2.0):
    """A copy of `model` whose greedy completions differ from its own."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.std().clamp_min(1e-3))
    return other


def _tag(engine, tag: int, weights=None, bucket_bytes: int = 1 << 20) -> None:
    """A push tagged `tag` (of `weights`, or only the tag), as the trainer makes it."""
    with engine.push_in_flight(tag):
        if weights is not None:
            push_weights(engine, weights, bucket_bytes=bucket_bytes)


def _in_another_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def assert_a_push_mid_generation_lands_between_segments_as_on_hf(engine, model, tokenizer, bucket_bytes=1 << 20):
    """Greedy generation tagged 0, a push of other weights tagged 1 made during the first segment: the completions
    equal HFEngine's segments with the same swap (tokens, log-probs to 1e-5, and each token's tag). The engine
    holds `model`, untagged, afterwards."""
    other = perturbed(model)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    counts = [2, 1, 1, 1]
    hf = HFEngine(copy.deepcopy(model), pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    calls = []

    def swap_before_the_second_segment():
        calls.append(1)
        if len(calls) == 2:
            hf.load_weights((n, p.detach()) for n, p in other.named_parameters())
        return int(len(calls) >= 2)

    want = generate_in_segments(hf.generate, ids, counts, PARAMS, SEGMENT, swap_before_the_second_segment,
                                tokenizer.eos_token_id)
    unswapped = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id).generate(ids, counts,
                                                                                                      PARAMS)
    assert any(c.token_ids[SEGMENT:].tolist() != u.token_ids[SEGMENT:].tolist()  # the swap changes what follows
               for g, h in zip(want, unswapped) for c, u in zip(g, h))

    push_weights(engine, model, bucket_bytes=bucket_bytes)
    once, segments, segment_tokens = engine._generate_once, [], engine._segment_tokens

    def once_then_push(*args):
        out = once(*args)
        segments.append(1)
        if len(segments) == 1:  # the trainer's push, from its own thread, while the engine generates
            _in_another_thread(lambda: _tag(engine, 1, other, bucket_bytes))
        return out

    _in_another_thread(lambda: _tag(engine, 0))  # as the pipeline tags it: this thread's generations go in segments
    engine._generate_once, engine._segment_tokens = once_then_push, SEGMENT
    try:
        got = engine.generate(ids, counts, PARAMS)
    finally:
        del engine._generate_once
        engine._segment_tokens, engine._tag = segment_tokens, None
    assert len(segments) == 3  # 10 tokens in segments of 4, 4 and 2
    for got_group, want_group in zip(got, want, strict=True):
        for g, w in zip(got_group, want_group, strict=True):
            assert g.token_ids.tolist() == w.token_ids.tolist() and g.finish_reason == w.finish_reason
            assert g.versions.tolist() == w.versions.tolist() == [0] * SEGMENT + [1] * (10 - SEGMENT)
            assert torch.allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0), (g.logprobs - w.logprobs).abs().max()
    push_weights(engine, model, bucket_bytes=bucket_bytes)
