"""SGLang serving a LoRA policy, live on a CPU (`lora_sync=adapter`, sglang's `torch_native` LoRA kernels): the base
arrives once by HF name, then each adapter as tensors (`Engine.load_lora_adapter_from_tensors`); what it samples
with the adapter matches the trainer's LoRA policy; C3PO's N sampled adapters decode in one call, each request with
its own adapter; a dropped adapter is caught by the post-push check; a sleep drops the adapters and the next push
brings base and adapter again. Policy: the tiny model, untrained, with random adapters (B ≠ 0)."""

import pytest
import torch

import sys
from pathlib import Path

from lit_rlvr.rollout.engine import SamplingParams
from sglang_live import cpu_options, live

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared checks
from lora_live import assert_blocks_match_each_adapter  # noqa: E402

pytestmark = live
PROMPTS = ["12+34=", "5+5=", "71-18="]


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

    model, tokenizer = build_tiny(seed=0)
    model = apply_lora(model, LoraOptions(rank=4), seed=0).eval()
    randomise_adapters(model, seed=1)
    return model, tokenizer


@pytest.fixture(scope="module")
def sync(lora_policy):
    """The engine with the policy pushed, and the `WeightSync` that pushed it (what the engine holds)."""
    from lit_rlvr.rollout.sglang import SGLangEngine
    from lit_rlvr.rollout.weight_sync import WeightSync

    model, tokenizer = lora_policy
    eng = SGLangEngine(model, tokenizer, **cpu_options(max_loras=4, base_port=32000))
    assert eng.serves_lora and eng.serves_many_adapters and eng.lora_sync == "adapter"
    weight_sync = WeightSync(eng, model)
    pushed = weight_sync.push(step=0).nbytes
    base = sum(p.numel() * 4 for n, p in model.named_parameters() if ".lora_" not in n)
    adapter = sum(p.numel() * 4 for n, p in model.named_parameters() if ".lora_" in n)
    assert pushed == base + adapter  # the first push: the base by name, then the adapter
    assert weight_sync.push(step=0).nbytes == adapter  # later pushes: the adapter alone
    yield weight_sync
    eng.shutdown()


@pytest.fixture(scope="module")
def engine(sync):
    return sync.engine


def _ids(tokenizer, prompts=PROMPTS):
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def _hf_engine(model, tokenizer):
    from lit_rlvr.rollout.hf import HFEngine

    return HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)


def test_sampling_with_the_pushed_adapter_matches_the_trainers_lora_policy(engine, lora_policy):
    model, tokenizer = lora_policy
    prompts = _ids(tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ours = engine.generate(prompts, [1] * len(prompts), params)
    want = _hf_engine(model, tokenizer).generate(prompts, [1] * len(prompts), params)
    for (a,), (b,) in zip(ours, want):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    with torch.no_grad(), model.disable_adapter():  # the adapter does change what is sampled
        base = _hf_engine(model, tokenizer).generate(prompts, [1] * len(prompts), params)
    assert [c[0].token_ids.tolist() for c in base] != [c[0].token_ids.tolist() for c in ours]


def test_c3po_sampled_adapters_decode_in_one_call_each_with_its_own(sync, engine, lora_policy):
    model, tokenizer = lora_policy
    prompts = _ids(tokenizer)[:2]
    adapters = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(5)
    stacks = {p: p.detach() + 0.3 * torch.randn((3, *p.shape), generator=gen) for p in adapters}
    params = [SamplingParams(temperature=0.0, max_new_tokens=8, seed=s) for s in range(3)]
    calls, real = [], engine._engine.generate
    engine._engine.generate = lambda *a, **k: calls.append(len(k["input_ids"])) or real(*a, **k)
    try:
        got = engine.generate_stacked(prompts, [[1, 1]] * 3, sync.load_samples(stacks, params, step=7), None)
    finally:
        del engine._engine.generate
    assert calls == [6]  # one engine call for the 3 adapters' rows
    assert_blocks_match_each_adapter(got, model, tokenizer, prompts, [1, 1], params, stacks, atol=1e-5)
    assert engine._active_adapter == sync.adapter  # the samples were loaded aside: the mean is the default


def test_an_adapter_that_never_arrives_is_caught_and_a_sleep_starts_over(sync, engine, lora_policy):
    from lit_rlvr.rollout.lora import EngineSyncError, SyncCheck, check_engine_sync, probe_prompt

    model, tokenizer = lora_policy
    check = SyncCheck()
    assert float(check_engine_sync(engine, model, probe_prompt(tokenizer), check=check, version=0)) < 1e-5
    saved = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    randomise_adapters(model, seed=9)  # a training step's new adapter ...
    engine.load_adapter = lambda *a, **k: None  # ... that the engine drops
    try:
        sync.push(step=1)
        with pytest.raises(EngineSyncError, match="not sampling the policy being trained"):
            check_engine_sync(engine, model, probe_prompt(tokenizer), check=check, version=1)
    finally:
        del engine.load_adapter
        with torch.no_grad():
            for p, v in zip([p for p in model.parameters() if p.requires_grad], saved):
                p.copy_(v)
    engine.sleep()  # adapters unloaded, the base released: the next push brings both
    assert not engine.holds_weights and engine._active_adapter is None and not engine._adapters
    assert not sync.holds(1)  # the owner sees the weights gone
    base = sum(p.numel() * 4 for n, p in model.named_parameters() if ".lora_" not in n)
    assert sync.push(step=2).nbytes > base
    assert float(check_engine_sync(engine, model, probe_prompt(tokenizer), check=check, version=2)) < 1e-5
