"""HFEngine: behaviour log-probs match the training forward, cache on/off agree, copy mode, sampling options."""

import copy

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.models import load_policy
from lit_rlvr.rollout.driver import stop_token_ids
from lit_rlvr.rollout.engine import SamplingParams
from lit_rlvr.rollout import hf
from lit_rlvr.rollout.hf import HFEngine, decoding_rows, filter_logits
from lit_rlvr.rollout.weights import buckets, push_weights
from lit_rlvr.run.distributed import full_named_weights
from lit_rlvr.rollout.batch import RolloutPlan, rollouts_from_completions

PROMPTS = ["12+34=", "5+5=", "71-18=", "3*4="]


@pytest.fixture(scope="module")
def policy(tiny_path):
    model, tokenizer = load_policy(tiny_path)
    return model.eval(), tokenizer


def _plan(tokenizer):
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return RolloutPlan(PROMPTS, [46, 10, 53, 12], ids, [3] * len(PROMPTS))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_behaviour_logprobs_equal_training_forward(policy, temperature):
    model, tokenizer = policy
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    plan = _plan(tokenizer)
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=7)
    completions = engine.generate(plan.prompt_token_ids, plan.n_per_prompt, params)
    rollouts = rollouts_from_completions(plan, completions, source=0, pad_id=tokenizer.pad_token_id)
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], 1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.response_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.long().cumsum(-1) - 1).clamp_min(0)).logits
    width = rollouts.response_ids.shape[1]
    logp = F.token_logprobs(logits[:, -width - 1 : -1], rollouts.response_ids, temperature=temperature)
    diff = ((logp - rollouts.old_logp) * rollouts.response_mask).abs().max().item()
    assert diff <= 1e-5
    assert rollouts.response_mask.sum() > len(PROMPTS) * 3  # more than one token each on average


def test_cached_and_uncached_generation_agree(policy):
    model, tokenizer = policy
    plan = _plan(tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    outs = [HFEngine(model, pad_id=0, eos_id=2, use_cache=c).generate(plan.prompt_token_ids, plan.n_per_prompt,
                                                                      params) for c in (True, False)]
    for a_group, b_group in zip(*outs):
        for a, b in zip(a_group, b_group):
            assert torch.equal(a.token_ids, b.token_ids)
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
            assert a.finish_reason == b.finish_reason


def test_shared_prefill_equals_one_prefill_per_row(policy):
    """A group's samples share one prompt prefill (cache rows repeated); each completion must be what a
    separate prefill per row gives: same tokens, log-probs within fp32 rounding, same finish reasons."""
    model, tokenizer = policy
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+7=", "3*4=", "12+7=", "100-1=")] * 3
    seeds = torch.arange(len(rows), dtype=torch.long) * 7919 + 11
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=0)
    shared, separate = (HFEngine(model, pad_id=0, eos_id=2, share_prefill=s)._sample(rows, params, seeds)
                        for s in (True, False))
    for a, b in zip(shared, separate, strict=True):
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.finish_reason == b.finish_reason
    assert len({tuple(c.token_ids.tolist()) for c in shared}) > 1  # the rows did not all sample the same


def test_seed_determinism_and_finish_reasons(policy):
    model, tokenizer = policy
    engine = HFEngine(model, pad_id=0, eos_id=2)
    plan = _plan(tokenizer)
    run = lambda seed, n: engine.generate(plan.prompt_token_ids, plan.n_per_prompt, SamplingParams(max_new_tokens=n,
                                                                                                   seed=seed))
    first, again, other = run(1, 12), run(1, 12), run(2, 12)
    flat = lambda out: [c.token_ids.tolist() for group in out for c in group]
    assert flat(first) == flat(again)
    assert flat(first) != flat(other)
    for group in run(1, 1):  # one token: finished only if it was eos
        for c in group:
            assert c.finish_reason == ("stop" if c.token_ids[-1].item() == 2 else "length")
            assert len(c.token_ids) == 1
    for group in first:
        for c in group:
            if c.finish_reason == "stop":
                assert c.token_ids[-1].item() == 2 and (c.token_ids[:-1] != 2).all()


def test_greedy_is_argmax_and_stop_tokens(policy):
    model, tokenizer = policy
    engine = HFEngine(model, pad_id=0, eos_id=2)
    ids = [tokenizer("5+5=", add_special_tokens=False)["input_ids"]]
    out = engine.generate(ids, [2], SamplingParams(temperature=0, max_new_tokens=6))[0]
    assert torch.equal(out[0].token_ids, out[1].token_ids)
    with torch.no_grad():
        first = model(input_ids=torch.tensor(ids)).logits[0, -1].argmax().item()
    assert out[0].token_ids[0].item() == first
    stop_id = out[0].token_ids[0].item()  # stop on the very first token the model emits
    out = engine.generate(ids, [1], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(stop_id,)))[0][0]
    assert out.token_ids.tolist() == [stop_id] and out.finish_reason == "stop"


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.7))  # 0.5 < 0.7, 0.5 + 0.3 crosses it
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.4))
    assert kept.tolist() == [[True, False, False, False]]


def test_copy_mode_follows_pushed_weights(policy):
    model, tokenizer = policy
    engine = HFEngine(model, pad_id=0, eos_id=2, mode="copy")
    assert engine.model is not model
    changed = {name: p.detach() + 0.01 for name, p in model.named_parameters()}
    engine.load_weights(changed.items())
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, changed[name])
    # bucketed push: every tensor arrives once whatever the bucket size, and the result is identical
    for cap in (1, 4096, 1 << 30):
        engine.load_weights((n, torch.zeros_like(t)) for n, t in changed.items())
        pushed = push_weights(engine, model, bucket_bytes=cap)
        assert pushed == sum(p.numel() * 4 for p in model.parameters())
        assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in engine.model.named_parameters())
    sizes = [len(b) for b in buckets(full_named_weights(model), 1)]
    assert sum(sizes) == len(list(model.parameters())) and max(sizes) == 1
    with pytest.raises(KeyError, match="unknown parameter"):
        engine.load_weights([("nope", torch.zeros(1))])


def test_counter_uniforms_are_uniform_and_keyed_by_row_and_step():
    from lit_rlvr.rollout.hf import counter_uniforms

    seeds = torch.arange(20_000, dtype=torch.long) * 2654435761
    u = counter_uniforms(seeds, 0)  # [R]
    assert u.min() >= 0 and u.max() < 1
    counts = torch.histc(u.float(), bins=10, min=0, max=1)  # 2000 expected per bin, sd ≈ 42
    assert (counts - 2000).abs().max() < 200, counts
    assert abs(float(torch.corrcoef(torch.stack([u, counter_uniforms(seeds, 1)]))[0, 1])) < 0.03
    assert torch.equal(counter_uniforms(seeds[5:6], 3), counter_uniforms(seeds, 3)[5:6])  # row-local


def test_counter_uniforms_are_splitmix64():
    """Against a plain-Python splitmix64 (unsigned 64-bit arithmetic), top 53 bits / 2^53."""
    from lit_rlvr.rollout.hf import counter_uniforms

    def splitmix64(x: int) -> float:
        m = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return ((z ^ (z >> 31)) >> 11) / 2**53

    seeds = [0, 1, 12345, -5, 2**62 + 3]
    assert counter_uniforms(torch.tensor(seeds), 0).tolist() == [splitmix64(s & ((1 << 64) - 1)) for s in seeds]


def test_sampling_does_not_depend_on_the_batch_a_prompt_shares(policy):
    """A prompt's completions are the same alone, in a batch, or behind other prompts (what makes a 2-rank run
    sample what the 1-rank run samples)."""
    model, tokenizer = policy
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, max_batch=5)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)
    together = engine.generate(ids, [3] * len(ids), params)
    for b in range(len(ids)):
        alone = engine.generate([ids[b]], [3], params)[0]
        assert [c.token_ids.tolist() for c in alone] == [c.token_ids.tolist() for c in together[b]]
    reversed_order = engine.generate(ids[::-1], [3] * len(ids), params)[::-1]
    def ids_of(completions):
        return [[c.token_ids.tolist() for c in per] for per in completions]

    assert ids_of(reversed_order) == ids_of(together)
    other_seed = engine.generate(ids, [3] * len(ids), SamplingParams(temperature=1.0, max_new_tokens=8, seed=12))
    assert ids_of(other_seed) != ids_of(together)


def test_inverse_cdf_sampling_matches_the_distribution():
    """The first token's empirical frequencies over many rows follow softmax(logits / T)."""
    from lit_rlvr.rollout.hf import counter_uniforms

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).expand(40_000, 5)
    params = SamplingParams(temperature=0.8)
    token, logp = HFEngine._pick(logits, params, counter_uniforms(torch.arange(40_000) * 7919, 0))
    expected = torch.softmax(logits[0] / 0.8, -1)
    freq = torch.bincount(token, minlength=5).double() / 40_000
    assert torch.allclose(freq, expected.double(), atol=0.01), (freq, expected)
    assert int((token == 4).sum()) == 0  # probability 0 is never drawn
    torch.testing.assert_close(logp, torch.log(expected)[token])


def test_sampling_stops_at_the_generation_configs_eos_ids_too(tiny_path):
    from lit_rlvr.module import GRPOModule

    module = GRPOModule(model=tiny_path, group_size=4, max_new_tokens=6)
    eos = module.tokenizer.eos_token_id
    assert module.sampling.stop_token_ids == ()  # the tiny model's generation config names only eos
    module.policy.generation_config.eos_token_id = [eos, 7, 5]
    assert stop_token_ids(module.policy, eos) == (5, 7)


def test_decoding_rows_keeps_every_unfinished_row_in_equal_blocks():
    finished = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)  # 2 blocks of 6
    block = torch.arange(12) // 6
    keep = decoding_rows(finished, block, 2)
    assert keep.tolist() == [0, 3, 8, 9]  # block 0: its unfinished row 3, topped up with finished row 0
    assert decoding_rows(finished, torch.zeros(12, dtype=torch.long), 1).tolist() == [3, 8, 9]
    assert decoding_rows(torch.zeros(12, dtype=torch.bool), block, 2) is None  # nothing finished
    assert decoding_rows(finished.clone().fill_(False).index_fill(0, torch.tensor([0, 6]), True), block, 2) is None


@pytest.mark.parametrize("stacked", [False, True])
def test_finished_rows_leave_the_decoding_batch_without_changing_samples(policy, monkeypatch, stacked):
    """Rows that have finished are cut from the batch (and the KV cache) as the batch shrinks; each completion must
    be what decoding every row to the end gives, and the forwards must have run on fewer rows."""
    model, tokenizer = policy
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = [SamplingParams(temperature=2.5, max_new_tokens=24, seed=5 + s) for s in range(2)]
    stacks = {p: p.detach() + 0.02 * torch.randn((2, *p.shape), generator=torch.Generator().manual_seed(0))
              for p in model.parameters()}

    def run(cut: bool):
        engine = HFEngine(model, pad_id=0, eos_id=2)
        rows = []
        forward = engine._forward
        engine._forward = lambda ids, mask, cache=None, **kw: rows.append(len(ids)) or forward(ids, mask, cache, **kw)
        if not cut:
            monkeypatch.setattr(hf, "decoding_rows", lambda *a: None)
        if stacked:
            out = engine.generate_stacked(ids, [[4] * 4] * 2, params, stacks)
        else:
            out = [engine.generate(ids, [8] * 4, params[0])]
        monkeypatch.undo()
        return [c for source in out for group in source for c in group], rows

    (cut, cut_rows), (full, full_rows) = run(True), run(False)
    lengths = [len(c.token_ids) for c in full]
    assert min(lengths) < max(lengths)  # finishing times differ, so there is something to cut
    for a, b in zip(cut, full, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    assert len(cut_rows) == len(full_rows) and sum(cut_rows) < sum(full_rows)


def test_ignore_eos_runs_every_completion_to_max_new_tokens(policy):
    model, tokenizer = policy
    engine = HFEngine(model, pad_id=0, eos_id=2)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    stops = engine.generate(ids, [4] * 4, SamplingParams(max_new_tokens=16, seed=1))
    assert any(c.finish_reason == "stop" for group in stops for c in group)  # the eos would have stopped some
    stop_id = stops[0][0].token_ids[0].item()  # a token the model does sample: stop ids are ignored too (as SGLang)
    ignored = SamplingParams(max_new_tokens=16, seed=1, ignore_eos=True, stop_token_ids=(stop_id,))
    for group in engine.generate(ids, [4] * 4, ignored):
        assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in group)


def test_growing_cache_layer_equals_transformers_dynamic_layer():
    """Appends in place (reallocating when the room runs out) and row selection give the keys and values that
    transformers' concatenating layer gives."""
    from transformers.cache_utils import DynamicLayer

    from lit_rlvr.rollout.kv_cache import GrowingLayer

    g = torch.Generator().manual_seed(0)
    ours, theirs = GrowingLayer(room=100), DynamicLayer()
    tight = GrowingLayer(room=0)  # a room too small: it reallocates at each append, and stays right
    steps = [5] + [1] * 80  # a prefill, then one token at a time: the buffer grows (by 64, then doubling, up to 105)
    for i, new in enumerate(steps):
        k, v = torch.randn(4, 2, new, 3, generator=g), torch.randn(4, 2, new, 3, generator=g)
        got, want, got_tight = ours.update(k, v), theirs.update(k, v), tight.update(k, v)
        assert all(torch.equal(a, b) and torch.equal(c, b) for a, b, c in zip(got, want, got_tight))
        assert ours.get_seq_length() == theirs.get_seq_length() == sum(steps[: i + 1])
        assert ours._buffers[0].shape[-2] <= 2 * ours.length + 64  # reserves at most what it holds, + 64
        assert ours._buffers[0].shape[-2] <= 5 + 100  # and never past the last position: the prefill's + room
        if i == 2:
            for layer in (ours, theirs, tight):
                layer.batch_select_indices(torch.tensor([3, 1, 1, 0]))
            # the selection runs before the next append, so the keys must still line up after it
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_growing_cache_keeps_other_layer_types_and_bounds_what_it_reserves():
    from transformers import Qwen3Config
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from lit_rlvr.rollout.kv_cache import GrowingLayer, growing_cache

    config = Qwen3Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                         use_sliding_window=True, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    cache = growing_cache(config, room=20000)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, GrowingLayer]
    keys = torch.zeros(3, 1, 5, 8)
    cache.layers[1].update(keys, keys)
    assert cache.layers[1]._buffers[0].shape[-2] == 5 + 64  # not 5 + 20000: room is reserved as the rows grow


def test_shared_and_copy_engines_differ_only_by_the_weights_requires_grad(policy):
    """Issue 61, class 14: why async S = 0 (a `copy` engine) is the default synchronous run (a `shared` engine) to
    rounding only. The shared engine samples with the trainer's parameters, which require grad, and PyTorch's matmul
    takes another kernel path for them; the same engine on the same weights without grad is the copy engine, bit for
    bit, and both agree to rounding either way."""
    model, tokenizer = policy
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)
    trainer_weights = copy.deepcopy(model).requires_grad_(True)
    shared = HFEngine(trainer_weights, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="shared")
    copied = HFEngine(trainer_weights, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")

    def sample(engine):
        return [c for per_prompt in engine.generate(ids, [4] * len(ids), params) for c in per_prompt]

    with_grad, own = sample(shared), sample(copied)
    trainer_weights.requires_grad_(False)
    without_grad = sample(shared)
    for a, b, c in zip(with_grad, own, without_grad):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(b.token_ids, c.token_ids)
        assert torch.equal(b.logprobs, c.logprobs)  # one kernel path: bit for bit
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)  # two paths: to rounding
