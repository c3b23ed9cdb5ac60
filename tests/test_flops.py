"""`functional.flops` against torch's own FLOP counter (`torch.utils.flop_counter.FlopCounterMode`) on the tiny
model: a forward, a forward + backward as the update runs it, and the HF engine's generation (plain and with
stacked weight samples, as C3PO generates).

Tolerance: none. The counter sees every matmul (`mm`, `bmm`) at its shapes; with eager attention and no padding
its count is an integer that ours must equal once the terms it counts and model FLOPs leave out are added:
* the masked half of causal attention: the kernel multiplies a full [T, T] score matrix and throws the upper
  triangle away; model FLOPs count each query's T(T+1)/2 real (query, key) pairs;
* the update's extra LM-head position: `forward_logprobs` keeps `width + 1` logits and drops the last (it would
  predict the token after the response).
Attention through SDPA on a CPU is `aten._scaled_dot_product_flash_attention_for_cpu`, which the counter has no
formula for: it would not see attention at all, hence eager attention here. Padding is excluded by design (the
counter would count it), so the inputs here have none; `test_hand_worked_forward` covers the lengths.
"""

import copy
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lit_rlvr import functional as F
from lit_rlvr.functional.flops import forward_flops
from lit_rlvr.models.tiny import build_tiny
from lit_rlvr.rollout.engine import SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.run.perf import transformer_shape


@pytest.fixture(scope="module")
def model():
    model, _ = build_tiny(seed=0)  # 2 layers, d 64, 4 query heads, 2 key/value heads of 16, MLP 192, V 101
    model.set_attn_implementation("eager")  # the counter's formulas do not cover the CPU SDPA kernel
    return model


@pytest.fixture(scope="module")
def shape(model):
    return transformer_shape(model.config)


def counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def masked_half(shape, rows: int, length: int) -> float:
    """FLOPs the eager kernel spends on the masked upper triangle of `rows` causal [length, length] scores."""
    masked_pairs = length * length - length * (length + 1) / 2
    return 4.0 * shape["layers"] * shape["heads"] * shape["head_dim"] * rows * masked_pairs


def test_hand_worked_forward():
    """1 layer, d 2, I 3, 1 head of 2, V 5: W = 2·2·2 + 2·2·2 + 3·2·3 = 34. A row of n = 2 new positions after
    c = 1 cached, head at 1: linear 2·34·2 = 136, head 2·2·5 = 20, attention 4·2·(2·1 + 3) = 40 (keys 2 and 3).
    A padded row adds nothing: only the lengths count."""
    dims = dict(layers=1, hidden=2, intermediate=3, heads=1, kv_heads=1, head_dim=2, vocab=5)
    total, parts = forward_flops(torch.tensor([2]), torch.tensor([1]), torch.tensor([1]), **dims)
    assert {k: float(v) for k, v in parts.items()} == {"linear": 136.0, "head": 20.0, "attention": 40.0}
    assert float(total) == 196.0
    two, _ = forward_flops(torch.tensor([2, 0]), torch.tensor([1, 7]), torch.tensor([1, 0]), **dims)
    assert float(two) == 196.0
    # generation of a 3-token completion after a 4-token prompt: prefill F(4, 0, 1) + decode F(2, 4, 2)
    gen, gen_parts = F.generation_flops(torch.tensor([4]), torch.tensor([4]), torch.tensor([3]), **dims)
    prefill, _ = forward_flops(torch.tensor([4]), torch.tensor([0]), torch.tensor([1]), **dims)
    decode, _ = forward_flops(torch.tensor([2]), torch.tensor([4]), torch.tensor([2]), **dims)
    assert float(gen) == float(prefill + decode) and float(gen_parts["prefill"]) == float(prefill)
    # the update: 3 forwards per pass; a reference model adds one, activation checkpointing the layers again
    upd, _ = F.update_flops(torch.tensor([4]), torch.tensor([3]), passes=2, reference=True, recompute=True, **dims)
    full, _ = forward_flops(torch.tensor([7]), torch.tensor([0]), torch.tensor([3]), **dims)
    body, _ = forward_flops(torch.tensor([7]), torch.tensor([0]), torch.tensor([0]), **dims)
    assert float(upd) == 2 * (3 * float(full) + float(full) + float(body))
    # the decoupled rollout correction's forward for π_old: one more forward, once (not per pass)
    upd_old, parts = F.update_flops(torch.tensor([4]), torch.tensor([3]), passes=2, old_forward=True, **dims)
    assert float(upd_old) == 2 * 3 * float(full) + float(full) and float(parts["old_forward"]) == float(full)
    # LoRA with P = 10 adapter multiply-adds per position, frozen base: projections and head 2 forwards, attention
    # 3, the adapters 6·P per position (7 positions); generation adds 2·P per prefilled and decoded position
    _, terms = forward_flops(torch.tensor([7]), torch.tensor([0]), torch.tensor([3]), **dims)
    lora, _ = F.update_flops(torch.tensor([4]), torch.tensor([3]), adapter=10, **dims)
    assert float(lora) == 2 * float(full) + float(terms["attention"]) + 6 * 10 * 7
    gen_lora, _ = F.generation_flops(torch.tensor([4]), torch.tensor([4]), torch.tensor([3]), adapter=10, **dims)
    assert float(gen_lora) == float(gen) + 2 * 10 * (4 + 2)
    # with adapters, a recomputed forward (activation checkpointing) and π_old's forward run them too: + 2·P each
    _, lora_parts = F.update_flops(torch.tensor([4]), torch.tensor([3]), adapter=10, recompute=True,
                                   old_forward=True, **dims)
    assert float(lora_parts["recompute"]) == float(body) + 2 * 10 * 7
    assert float(lora_parts["old_forward"]) == float(full) + 2 * 10 * 7
    # an empty completion has no decode step (its first token would come from the prefill): the prefill alone
    empty, empty_parts = F.generation_flops(torch.tensor([4]), torch.tensor([4]), torch.tensor([0]), **dims)
    assert float(empty_parts["decode"]) == 0.0 and float(empty) == float(prefill)


def test_forward_matches_the_counter(model, shape):
    rows, length = 3, 10
    ids = torch.randint(4, 101, (rows, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seen = counted(lambda: model(input_ids=ids, logits_to_keep=0))
    ours, parts = forward_flops(torch.full((rows,), length), torch.zeros(rows), torch.full((rows,), length), **shape)
    assert seen == float(ours) + masked_half(shape, rows, length)
    assert float(parts["attention"]) > 0 and float(parts["head"]) > 0


def test_forward_backward_matches_the_counter(model, shape):
    """The update's forward (`lit_rlvr.update.forward_logprobs`: logits_to_keep = width + 1, the last dropped), the
    log-probs of the response, backward: 3 forwards, the counter and ours."""
    rows, prompt, response = 4, 6, 9
    ids = torch.randint(4, 101, (rows, prompt + response), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)

    def update():
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=response + 1).logits[:, :-1]
        logp = F.token_logprobs(logits, ids[:, prompt:], temperature=1.0)
        logp.sum().backward()

    seen = counted(update)
    model.zero_grad(set_to_none=True)
    ours, _ = F.update_flops(torch.full((rows,), prompt), torch.full((rows,), response), **shape)
    dropped_logits = 3 * 2.0 * shape["hidden"] * shape["vocab"] * rows  # forward + backward of the extra position
    assert seen == float(ours) + 3 * masked_half(shape, rows, prompt + response) + dropped_logits


def test_lora_forward_backward_matches_the_counter(model, shape):
    """The update on rank-4 adapters over every linear layer (the base frozen): the counter and ours. Two terms ours
    leaves out: the extra LM-head position (now 2 forwards: the frozen head's input gradient only), and the first
    layer's q, k, v projections and their adapters' A, whose input (the embeddings, frozen) needs no gradient."""
    from lit_rlvr.config.settings import LoraOptions
    from lit_rlvr.models.lora import apply_lora, lora_layers

    policy = apply_lora(copy.deepcopy(model), LoraOptions(rank=4))
    adapter = sum(p.numel() for n, p in policy.named_parameters() if ".lora_" in n)
    assert adapter == sum(4 * (layer.in_features + layer.out_features) for _, layer in lora_layers(policy))
    rows, prompt, response = 3, 5, 8
    ids = torch.randint(4, 101, (rows, prompt + response), generator=torch.Generator().manual_seed(4))

    def update():
        logits = policy(input_ids=ids, logits_to_keep=response + 1).logits[:, :-1]
        F.token_logprobs(logits, ids[:, prompt:], temperature=1.0).sum().backward()

    seen = counted(update)
    ours, _ = F.update_flops(torch.full((rows,), prompt), torch.full((rows,), response), adapter=adapter, **shape)
    tokens = rows * (prompt + response)
    dropped_logits = 2 * 2.0 * shape["hidden"] * shape["vocab"] * rows
    qkv_out = (shape["heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
    first_layer_inputs = 2.0 * tokens * (shape["hidden"] * qkv_out + 3 * 4 * shape["hidden"])
    assert seen == float(ours) + 3 * masked_half(shape, rows, prompt + response) + dropped_logits \
        - first_layer_inputs


def _engine_case(shape, prompts: int, group: int, prompt_len: int, new: int, sources: int = 1):
    """Prompts of one length (no padding), every completion `new` tokens long (ignore_eos: no row leaves early)."""
    gen = torch.Generator().manual_seed(2)
    token_ids = [torch.randint(4, 101, (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=3, ignore_eos=True)
    rows = prompts * group * sources
    ours, _ = F.generation_flops(torch.full((prompts * sources,), prompt_len), torch.full((rows,), prompt_len),
                                 torch.full((rows,), new), **shape)
    return token_ids, params, float(ours) + masked_half(shape, prompts * sources, prompt_len)


def test_generation_matches_the_counter(model, shape):
    """`HFEngine.generate` (one shared prefill per prompt, then decode steps over the growing cache)."""
    token_ids, params, expected = _engine_case(shape, prompts=3, group=4, prompt_len=7, new=12)
    engine = HFEngine(model.eval(), pad_id=0, eos_id=2)
    out = []
    seen = counted(lambda: out.append(engine.generate(token_ids, [4] * 3, params)))
    assert all(len(c.token_ids) == 12 for per in out[0] for c in per)
    assert seen == expected


def test_stacked_generation_matches_the_counter(model, shape):
    """C3PO's N weight samples in one stacked call compute what N separate calls would: each source prefills its
    own prompts (other weights, other cache) and decodes its own rows."""
    token_ids, params, expected = _engine_case(shape, prompts=2, group=2, prompt_len=5, new=8, sources=3)
    engine = HFEngine(model.eval(), pad_id=0, eos_id=2)
    stacks = {p: torch.stack([p.detach() * (1 + 0.01 * s) for s in range(3)]) for p in model.parameters()}
    seen = counted(lambda: engine.generate_stacked(token_ids, [[2, 2]] * 3,
                                                   [replace(params, seed=s) for s in range(3)],
                                                   stacks))
    assert seen == expected
