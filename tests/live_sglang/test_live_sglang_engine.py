"""The real `sglang.Engine` behind `SGLangEngine`, fp32, on a CPU, against `HFEngine` (one engine for the module,
multi-turn rollouts included: tests/multi_turn_live.py's checks).

Greedy decoding is compared token for token (log-probs within 1e-5); sampled completions are checked for form
and against the model's own log-probs (sglang ignores per-request seeds on a CPU, so they cannot be compared
draw for draw). The engine starts with dummy weights: every output here comes from weights pushed by HF name.
"""

import copy
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_rlvr.rollout.engine import EngineError, SamplingParams
from lit_rlvr.rollout.weights import push_weights
from sglang_live import cpu_options, live

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared checks
from in_flight_live import assert_a_push_mid_generation_lands_between_segments_as_on_hf  # noqa: E402
from multi_turn_live import assert_greedy_transcripts_equal_hf, assert_sampled_rollouts_are_consistent  # noqa: E402

pytestmark = live
PROMPTS = ["12+34=", "5+5=", "71-18=", "3*4=", "100+200=", "9-9="]  # 3 to 8 tokens


@pytest.fixture(scope="module")
def policy(tiny_path):
    from lit_rlvr.models import load_policy

    model, tokenizer = load_policy(tiny_path, "float32")
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def engine(policy):
    from lit_rlvr.rollout.sglang import SGLangEngine

    model, tokenizer = policy
    engine = SGLangEngine(model, tokenizer, **cpu_options())
    yield engine
    engine.shutdown()


def _ids(tokenizer):
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _hf(model, tokenizer, prompts, counts, params):
    from lit_rlvr.rollout.hf import HFEngine

    return HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id).generate(prompts, counts,
                                                                                                  params)


def _assert_same(got, want, atol=1e-5):
    assert [len(g) for g in got] == [len(w) for w in want]
    for got_group, want_group in zip(got, want):
        for g, w in zip(got_group, want_group):
            assert g.token_ids.tolist() == w.token_ids.tolist() and g.finish_reason == w.finish_reason
            assert torch.allclose(g.logprobs, w.logprobs, atol=atol, rtol=0), (g.logprobs - w.logprobs).abs().max()


def _push(engine, model, bucket_bytes):
    """push_weights; returns how many buckets went to sglang."""
    buckets, original = [], engine.load_weights

    def counting(named_tensors):
        buckets.append(1)
        original(named_tensors)

    engine.load_weights = counting
    try:
        push_weights(engine, model, bucket_bytes=bucket_bytes)
    finally:
        del engine.load_weights
    assert engine.holds_weights
    return len(buckets)


def test_dummy_weights_then_bucketed_push_equals_hf_greedy_with_stop_tokens(engine, policy):
    model, tokenizer = policy
    prompts = _ids(tokenizer)
    with pytest.raises(RuntimeError, match="holds no weights"):
        engine.generate(prompts, [1] * len(prompts), SamplingParams(temperature=0.0))
    assert _push(engine, model, bucket_bytes=16 << 10) > 3  # several buckets, one sglang update session
    free = _hf(model, tokenizer, prompts, [1] * len(prompts), SamplingParams(temperature=0.0, max_new_tokens=10))
    # a stop token that greedy decoding reaches mid-completion in some row: both engines must stop on it
    stop = next(int(c.token_ids[1]) for g in free for c in g if len(c.token_ids) > 2)
    counts = [2, 1, 0, 1, 3, 1]
    for params in (SamplingParams(temperature=0.0, max_new_tokens=10),
                   SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,))):
        want = _hf(model, tokenizer, prompts, counts, params)
        _assert_same(engine.generate(prompts, counts, params), want)
    reasons = {c.finish_reason for g in want for c in g}
    assert reasons == {"stop", "length"} or reasons == {"stop"}
    assert any(int(c.token_ids[-1]) == stop for g in want for c in g)


def test_sampling_at_t1_uneven_counts_is_well_formed_and_scored_by_the_model(engine, policy):
    model, tokenizer = policy
    prompts, counts = _ids(tokenizer), [3, 0, 1, 2, 5, 1]
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    out = engine.generate(prompts, counts, params)
    assert [len(g) for g in out] == counts
    stops = {tokenizer.eos_token_id}
    for prompt, group in zip(prompts, out):
        for c in group:
            n = len(c.token_ids)
            assert 1 <= n <= 8 and c.logprobs.shape == (n,) and torch.isfinite(c.logprobs).all()
            assert (c.logprobs <= 0).all()
            ends = int(c.token_ids[-1]) in stops
            assert c.finish_reason == ("stop" if ends else "length") and (ends or n == 8)
            assert not any(int(t) in stops for t in c.token_ids[:-1])
            # the behaviour log-probs are the model's own, at T = 1
            ids = torch.tensor([prompt + c.token_ids.tolist()])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(1, c.token_ids[:, None]).squeeze(1)
            assert torch.allclose(c.logprobs, want, atol=1e-4, rtol=0), (c.logprobs - want).abs().max()


def test_outputs_follow_each_push(engine, policy):
    model, tokenizer = policy
    prompts, counts = _ids(tokenizer), [1] * len(PROMPTS)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5 * p.std().clamp_min(1e-3))
    before, after = _hf(model, tokenizer, prompts, counts, params), _hf(perturbed, tokenizer, prompts, counts, params)
    assert any(a[0].token_ids.tolist() != b[0].token_ids.tolist() for a, b in zip(after, before))  # a visible change
    _push(engine, perturbed, bucket_bytes=64 << 10)
    _assert_same(engine.generate(prompts, counts, params), after)
    _push(engine, model, bucket_bytes=64 << 10)
    _assert_same(engine.generate(prompts, counts, params), before)


def test_generate_sleep_wake_push_generate_20_cycles(engine, policy):
    """The training loop's engine calls back to back. sleep() straight after generate() used to trip sglang's
    'release_memory_occupation should be called only when server is idle' assert, and sglang then killed this
    process; sleep now waits (bounded) for the scheduler to let go of the last batch."""
    model, tokenizer = policy
    prompts, counts = _ids(tokenizer)[:3], [2, 1, 1]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    want = _hf(model, tokenizer, prompts, counts, params)
    for cycle in range(20):
        _assert_same(engine.generate(prompts, counts, params), want)
        engine.sleep()
        assert not engine.holds_weights
        engine.wake()
        push_weights(engine, model, bucket_bytes=64 << 10)
    _assert_same(engine.generate(prompts, counts, params), want)


def test_multi_turn_rollouts_equal_hf(engine, policy):
    """Multi-turn rollouts against HFEngine: greedy transcripts token for token, sampled ones consistent with the
    policy's forward."""
    model, tokenizer = policy
    push_weights(engine, model, bucket_bytes=1 << 20)
    assert_greedy_transcripts_equal_hf(engine, model, tokenizer)
    assert_sampled_rollouts_are_consistent(engine, model, tokenizer)


def test_a_push_made_while_sglang_generates_lands_between_two_segments(engine, policy):
    """rollout.partial_rollout=true on SGLang (lit_rlvr.rollout.segments): the push is staged, lands before the next
    segment (sglang's update session and cache flush in the generating thread), and the tokens after it are the new
    weights' greedy ones, each tagged with its version."""
    model, tokenizer = policy
    assert_a_push_mid_generation_lands_between_segments_as_on_hf(engine, model, tokenizer, bucket_bytes=64 << 10)


def test_a_dead_scheduler_is_an_engine_error_not_a_killed_process(engine, policy):
    """Last in the module: it kills this engine's scheduler. sglang's watchdog then signals this process, whose
    default answer is to kill it; the engine raises EngineError naming the dead process instead."""
    _, tokenizer = policy
    watchdog = engine._engine.tokenizer_manager._subprocess_watchdog
    scheduler = next(p for p, name in zip(watchdog._processes, watchdog._names) if "scheduler" in name.lower())
    os.kill(scheduler.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    with pytest.raises(EngineError, match=rf"pid {scheduler.pid}\) exited with code -9"):
        while time.monotonic() < deadline:  # until sglang's watchdog (1 s poll) has noticed
            engine.generate(_ids(tokenizer)[:1], [1], SamplingParams(temperature=0.0, max_new_tokens=4))
            time.sleep(0.5)
    with pytest.raises(EngineError, match="cannot"):
        engine.sleep()
    engine.shutdown()
    assert all(not p.is_alive() for p in watchdog._processes)
