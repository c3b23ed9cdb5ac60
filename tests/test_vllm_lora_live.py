"""vLLM serving a LoRA policy, live on this machine (`bash scripts/vllm_cpu_env.sh VENV && VENV/bin/pip install peft &&
VENV/bin/python -m pytest tests/test_vllm_lora_live.py`): the base weights arrive once by name, adapters by LoRA
request (vLLM's CPU backend runs them with its Punica CPU wrapper); what it samples with an adapter matches the
trainer's LoRA policy; C3PO's N sampled adapters decode in one call, each request with its own adapter; and the
post-push check catches an adapter that never arrived. Policy: the tiny architecture with head_dim 32 (vLLM's CPU
attention needs >= 32), untrained, with random adapters (B ≠ 0)."""

from __future__ import annotations

import pytest
import torch

from test_vllm_live import VLLM_ERROR, _alive, _policy_logprobs, _prompts

pytestmark = [pytest.mark.live_vllm, pytest.mark.skipif(VLLM_ERROR is not None, reason=str(VLLM_ERROR))]


def randomise_adapters(model, seed: int, scale: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def lora_policy():
    from lit_rlvr.config.settings import LoraOptions
    from lit_rlvr.models.lora import apply_lora
    from lit_rlvr.models.tiny import build_tiny

    model, tokenizer = build_tiny(0, hidden_size=64, heads=2)  # head_dim 32
    model = apply_lora(model, LoraOptions(rank=4), seed=0).eval()
    randomise_adapters(model, seed=1)
    return model, tokenizer


@pytest.fixture(scope="module")
def sync(lora_policy):
    """The engine with the policy pushed once, and the `WeightSync` that pushed it (what the engine holds)."""
    from lit_rlvr.rollout.vllm import VLLMEngine
    from lit_rlvr.rollout.weight_sync import WeightSync

    model, tokenizer = lora_policy
    eng = VLLMEngine(model, tokenizer, kv_cache_memory_bytes=64 << 20, dtype="float32", enforce_eager=True,
                     max_loras=4, bucket_bytes=4096)
    assert eng.serves_lora and eng.serves_many_adapters
    weight_sync = WeightSync(eng, model)
    pushed = weight_sync.push(step=0).nbytes
    base = sum(p.numel() * 4 for n, p in model.named_parameters() if ".lora_" not in n)
    adapter = sum(p.numel() * 4 for n, p in model.named_parameters() if ".lora_" in n)
    assert pushed == base + adapter  # the first push: the base by name, then the adapter
    yield weight_sync
    pids = eng.engine_pids()
    eng.shutdown()
    assert not _alive(pids, grace_s=20), "engine processes outlived shutdown()"


@pytest.fixture(scope="module")
def engine(sync):
    return sync.engine


def test_sampling_with_the_pushed_adapter_matches_the_trainers_lora_policy(engine, lora_policy):
    from lit_rlvr.rollout import SamplingParams
    from lit_rlvr.rollout.hf import HFEngine

    model, tokenizer = lora_policy
    prompts = _prompts(tokenizer)[:3]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ours = engine.generate(prompts, [1] * len(prompts), params)
    hf = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id).generate(
        prompts, [1] * len(prompts), params)
    for (a,), (b,) in zip(ours, hf):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    sampled = engine.generate(prompts[:1], [1], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))[0][0]
    torch.testing.assert_close(sampled.logprobs, _policy_logprobs(model, prompts[0], sampled.token_ids, 1.0),
                               rtol=0, atol=1e-4)
    with torch.no_grad(), model.disable_adapter():  # the adapter does change what is sampled
        base = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id).generate(
            prompts, [1] * len(prompts), params)
    assert [c[0].token_ids.tolist() for c in base] != [c[0].token_ids.tolist() for c in ours]


def test_c3po_sampled_adapters_decode_in_one_call_each_with_its_own(sync, engine, lora_policy):
    from lora_live import assert_blocks_match_each_adapter

    from lit_rlvr.rollout import SamplingParams

    model, tokenizer = lora_policy
    prompts = _prompts(tokenizer)[:2]
    adapters = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(5)
    stacks = {p: p.detach() + 0.3 * torch.randn((3, *p.shape), generator=gen) for p in adapters}
    params = [SamplingParams(temperature=0.0, max_new_tokens=8, seed=s) for s in range(3)]
    calls = []
    real = engine._llm.generate
    engine._llm.generate = lambda *a, **k: calls.append(len(a[0])) or real(*a, **k)
    try:
        got = engine.generate_stacked(prompts, [[1, 1]] * 3, sync.load_samples(stacks, params, step=7), None)
    finally:
        engine._llm.generate = real
    assert calls == [6]  # one engine call for the 3 adapters' rows
    assert_blocks_match_each_adapter(got, model, tokenizer, prompts, [1, 1], params, stacks, atol=1e-4)


def test_an_adapter_that_never_arrives_is_caught(sync, engine, lora_policy):
    from lit_rlvr.rollout.lora import EngineSyncError, SyncCheck, check_engine_sync, probe_prompt

    model, tokenizer = lora_policy
    check = SyncCheck()
    assert float(check_engine_sync(engine, model, probe_prompt(tokenizer), check=check, version=0)) < 1e-4
    saved = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    randomise_adapters(model, seed=9)  # a training step's new adapter ...
    real = engine.load_adapter
    engine.load_adapter = lambda *a: None  # ... that the engine drops
    try:
        sync.push(step=1)
        with pytest.raises(EngineSyncError, match="not sampling the policy being trained"):
            check_engine_sync(engine, model, probe_prompt(tokenizer), check=check, version=1)
    finally:
        engine.load_adapter = real
        with torch.no_grad():
            for p, v in zip([p for p in model.parameters() if p.requires_grad], saved):
                p.copy_(v)
    sync.push(step=2)  # a push that arrives: in step again
    assert float(check_engine_sync(engine, model, probe_prompt(tokenizer), check=check, version=2)) < 1e-4
