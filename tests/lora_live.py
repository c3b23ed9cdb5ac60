"""Checks of C3PO's sampled adapters on a live multi-adapter engine (vLLM, SGLang), shared by
tests/test_vllm_lora_live.py and tests/live_sglang/: each block of one stacked call matches HFEngine on the policy
with that block's adapter."""

from __future__ import annotations

import torch

from lit_rlvr.rollout.hf import HFEngine


def assert_blocks_match_each_adapter(got, model, tokenizer, prompts, counts, params, stacks, atol: float) -> None:
    """`got[s]` (the engine's completions of weight sample s) equals HFEngine's greedy completions with the
    adapters set to `stacks[p][s]`, tokens exactly and log-probs within `atol`; the samples differ from each other
    (each block ran its own adapter). The policy's adapters are restored afterwards."""
    adapters = list(stacks)
    saved = [p.detach().clone() for p in adapters]
    hf, outs = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id), []
    try:
        for s in range(len(got)):
            with torch.no_grad():
                for p in adapters:
                    p.copy_(stacks[p][s])
            want = hf.generate(prompts, counts, params[s])
            outs.append([c[0].token_ids.tolist() for c in want])
            assert [c[0].token_ids.tolist() for c in got[s]] == outs[-1], s
            for g, w in zip(got[s], want):
                torch.testing.assert_close(g[0].logprobs, w[0].logprobs, rtol=0, atol=atol)
    finally:
        with torch.no_grad():
            for p, v in zip(adapters, saved):
                p.copy_(v)
    assert len({str(o) for o in outs}) > 1
