"""`stacked_weights` and `HFEngine.generate_stacked`: N row blocks with N weight sets in one forward equal N plain
forwards; the model comes back untouched; C3PO in `shared` mode samples what the per-source path samples."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_rlvr.models import load_policy
from lit_rlvr.rollout.engine import SamplingParams
from lit_rlvr.rollout.hf import HFEngine, positions
from lit_rlvr.rollout.multi_weight import stacked_weights

PROMPTS = ["12+34=", "5+5=", "71-18=", "3*4="]
N = 3


@pytest.fixture(scope="module")
def policy(tiny_path):
    model, tokenizer = load_policy(tiny_path)
    return model.eval(), tokenizer


def noisy_stacks(model: nn.Module, num: int = N, scale: float = 0.05) -> dict[nn.Parameter, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {p: p.detach() + scale * torch.randn((num, *p.shape), generator=gen) for p in model.parameters()}


def load(model: nn.Module, stacks, n: int) -> None:
    with torch.no_grad():
        for p, s in stacks.items():
            p.copy_(s[n])


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_stacked_forward_equals_per_block_forwards(policy):
    model, tokenizer = policy
    stacks = noisy_stacks(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one stack serves both
    ids = torch.randint(1, tokenizer.vocab_size, (N * 2, 7))  # [N·R, L]
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False  # some left padding
    kwargs = dict(attention_mask=mask, position_ids=positions(mask), use_cache=False)
    mean = snapshot(model)
    with torch.no_grad():
        with stacked_weights(model, stacks):
            got = model(input_ids=ids, **kwargs).logits  # [N·R, L, V]
        want = []
        for n in range(N):
            load(model, stacks, n)
            rows = slice(2 * n, 2 * n + 2)
            want.append(model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=positions(mask[rows]),
                              use_cache=False).logits)
        for p, m in zip(model.parameters(), mean):
            p.copy_(m)
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)


def test_generate_stacked_equals_separate_generate_calls(policy):
    model, tokenizer = policy
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, max_batch=4)  # 2 windows
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    counts = [[2, 1, 0, 1], [1, 1, 1, 1], [0, 2, 2, 0]]  # equal totals, different splits
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=40 + s) for s in range(N)]
    stacks = noisy_stacks(model)
    mean = snapshot(model)
    got = engine.generate_stacked(ids, counts, params, stacks)
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), mean))
    for n in range(N):
        load(model, stacks, n)
        want = engine.generate(ids, counts[n], params[n])
        for got_b, want_b in zip(got[n], want):
            assert len(got_b) == len(want_b)
            for g, w in zip(got_b, want_b):
                assert torch.equal(g.token_ids, w.token_ids) and g.finish_reason == w.finish_reason
                torch.testing.assert_close(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
    load(model, {p: m[None] for p, m in zip(model.parameters(), mean)}, 0)


def test_generate_stacked_rejects_unequal_totals(policy):
    model, tokenizer = policy
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    params = [SamplingParams(seed=s) for s in range(2)]
    with pytest.raises(ValueError, match="equal totals"):
        engine.generate_stacked([[5, 6]], [[2], [1]], params, noisy_stacks(model, 2))


def test_model_restored_after_context_and_after_exception(policy):
    model, tokenizer = policy
    ids = torch.randint(1, tokenizer.vocab_size, (N, 5))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    mean = snapshot(model)
    with torch.no_grad(), stacked_weights(model, noisy_stacks(model)):
        pass
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), stacked_weights(model, noisy_stacks(model)):
        model(input_ids=ids)
        raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), mean))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_mode_switches_keep_the_per_block_forwards_and_a_replaced_one_is_an_error(policy):
    """A loaded policy has transformers' hub kernels off, so train()/eval() inside the context (the HF engine's
    eval_mode) keeps every patched forward; a forward replaced inside the context (as a re-kernelization would) is
    an error on exit, never samples silently ignored, and the model is restored."""
    model, tokenizer = policy
    assert not getattr(model, "use_kernels", False)
    with torch.no_grad(), stacked_weights(model, noisy_stacks(model)):
        patched = {id(m): m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__}
        model.train()
        model.eval()
        assert {id(m): m.__dict__.get("forward") for m in model.modules() if "forward" in m.__dict__} == patched
    norm = next(m for m in model.modules() if "Norm" in type(m).__name__)
    with pytest.raises(RuntimeError, match="was replaced while sampling"), torch.no_grad():
        with stacked_weights(model, noisy_stacks(model)):
            norm.__dict__.pop("forward")  # what kernelize's forward replacement does
    assert not any("forward" in m.__dict__ for m in model.modules())


class Scale(nn.Module):
    """A leaf with a 2-D parameter that is neither Linear nor Embedding: only the per-block loop fits it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.weight.T.tanh()


def test_other_leaf_modules_run_per_block():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), Scale(), nn.Linear(4, 3)).eval()
    stacks = noisy_stacks(model, num=2, scale=0.5)
    ids = torch.randint(0, 10, (4, 3))
    with torch.no_grad():
        with stacked_weights(model, stacks):
            got = model(ids)
        want = []
        for n in range(2):
            load(model, stacks, n)
            want.append(model(ids[2 * n : 2 * n + 2]))
    torch.testing.assert_close(got, torch.cat(want))


@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["full", "lora"])
def test_c3po_shared_engine_stacked_equals_per_source(monkeypatch, lora):
    from test_param_noise import fit, make_module

    from lit_rlvr.callbacks import ParamNoise

    def run(stacked: bool):
        module = make_module(engine_options={"mode": "shared"}, lora=lora)
        seen, calls = [], []
        real_setup = module.setup

        def setup(stage):
            real_setup(stage)
            real_rollout = module.driver.rollout

            def rollout(plan, **kw):
                result = real_rollout(plan, **kw)
                seen.append(result.rollouts)
                return result

            monkeypatch.setattr(module.driver, "rollout", rollout)
            if not stacked:
                monkeypatch.setattr(module.driver, "_can_stack", lambda plan, per_source: False)
            real_stacked = module.engine.generate_stacked
            module.engine.generate_stacked = lambda *a: calls.append(1) or real_stacked(*a)

        monkeypatch.setattr(module, "setup", setup)
        fit(module, ParamNoise("c3po", num_samples=2), steps=2)
        return module, seen, len(calls)

    stacked, stacked_rollouts, stacked_calls = run(True)
    plain, plain_rollouts, plain_calls = run(False)
    assert (stacked_calls, plain_calls) == (2, 0)  # one engine call per step for both weight samples
    for a, b in zip(stacked_rollouts, plain_rollouts):
        for name in ("response_ids", "response_mask", "group", "source", "rewards"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        torch.testing.assert_close(a.old_logp, b.old_logp, rtol=1e-5, atol=1e-5)
    # old_logp agree to fp32 rounding (batched vs per-source forwards); IVON's step divides by a per-weight curvature
    # near 0 on fresh LoRA weights, which grows that to ~3e-6 after 2 steps under AVX2 or 1 thread. A weight sample
    # paired with the wrong rollouts moves weights by up to a clipped step, 1e-2: 2e-5 still tells them apart
    torch.testing.assert_close(list(stacked.policy.parameters()), list(plain.policy.parameters()), rtol=1e-4, atol=2e-5)


# -- LoRA: N adapters over one shared base ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_policy(tiny_path):
    from lit_rlvr.config.settings import LoraOptions
    from lit_rlvr.models.lora import apply_lora

    model, tokenizer = load_policy(tiny_path)
    model = apply_lora(model, LoraOptions(rank=4)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a trained adapter: B ≠ 0
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model, tokenizer


def adapter_stacks(model: nn.Module, num: int = N, scale: float = 0.05) -> dict[nn.Parameter, torch.Tensor]:
    """N weight samples of the adapters alone (what C3PO's IVON posterior over a LoRA policy draws)."""
    gen = torch.Generator().manual_seed(2)
    return {p: p.detach() + scale * torch.randn((num, *p.shape), generator=gen)
            for p in model.parameters() if p.requires_grad}


def test_lora_stacked_sampling_runs_one_base_matmul_and_per_block_low_rank_terms(lora_policy):
    """Only the adapters' A and B run per block; every base layer keeps its own forward (one matmul for all
    rows) and no [N, out, in] copy of a base matrix is made."""
    model, tokenizer = lora_policy
    stacks = adapter_stacks(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(".lora_A." in names[id(p)] or ".lora_B." in names[id(p)] for p in stacks)
    base_bytes = sum(p.numel() for p in model.parameters() if not p.requires_grad) * 4
    stack_bytes = sum(s.numel() for s in stacks.values()) * 4
    assert stack_bytes < 0.5 * base_bytes  # N samples of the adapters, not of the model
    with torch.no_grad(), stacked_weights(model, stacks):
        patched = [n for n, m in model.named_modules() if "forward" in m.__dict__]
    assert patched and all(".lora_A." in n or ".lora_B." in n for n in patched)
    ids = torch.randint(1, tokenizer.vocab_size, (N * 2, 6))
    with torch.no_grad():
        with stacked_weights(model, stacks):
            got = model(input_ids=ids, use_cache=False).logits
        want = []
        for n in range(N):
            saved = snapshot_of(stacks)
            load(model, stacks, n)
            want.append(model(input_ids=ids[2 * n: 2 * n + 2], use_cache=False).logits)
            restore(saved)
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)  # logits: batched-matmul rounding


def snapshot_of(stacks) -> list[tuple[nn.Parameter, torch.Tensor]]:
    return [(p, p.detach().clone()) for p in stacks]


def restore(saved) -> None:
    with torch.no_grad():
        for p, value in saved:
            p.copy_(value)


def test_lora_generate_stacked_equals_separate_generate_calls(lora_policy):
    """C3PO on LoRA: N sampled adapters over the one base decode in one call; each block's tokens and log-probs
    are those of a separate call with that adapter loaded (within the rounding of a batched matmul)."""
    model, tokenizer = lora_policy
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, max_batch=4)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    counts = [[2, 1, 0, 1], [1, 1, 1, 1], [0, 2, 2, 0]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=70 + s) for s in range(N)]
    stacks = adapter_stacks(model)
    saved = snapshot_of(stacks)
    got = engine.generate_stacked(ids, counts, params, stacks)
    assert all(torch.equal(p, v) for p, v in saved)  # the adapters are untouched
    for n in range(N):
        load(model, stacks, n)
        want = engine.generate(ids, counts[n], params[n])
        for got_b, want_b in zip(got[n], want):
            assert len(got_b) == len(want_b)
            for g, w in zip(got_b, want_b):
                assert torch.equal(g.token_ids, w.token_ids) and g.finish_reason == w.finish_reason
                torch.testing.assert_close(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
    restore(saved)
