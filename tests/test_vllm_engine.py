"""VLLMEngine's request building, output parsing, push grouping and argument checks, without vLLM (the live
tests are in test_vllm_live.py)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from lit_rlvr.rollout import SamplingParams, build_engine
from lit_rlvr.rollout.vllm import engine_kwargs, fusion_key, parse_outputs, request_rows, split_complete


def test_requests_expand_n_per_prompt_with_seeds_keyed_by_prompt_not_batch():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, stop_token_ids=(9,), seed=3)
    prompts, sampling = request_rows([[1, 2], [3]], [2, 1], params, eos_id=2)
    assert prompts == [[1, 2], [1, 2], [3]]
    assert [s["seed"] for s in sampling][0] != sampling[1]["seed"]  # the rows of one prompt draw differently
    assert all(s["n"] == 1 and s["logprobs"] == 0 and s["stop_token_ids"] == [2, 9] for s in sampling)
    assert sampling[0]["temperature"] == 0.7 and sampling[0]["top_p"] == 0.9 and sampling[0]["top_k"] == 0
    assert sampling[0]["max_tokens"] == 5 and not sampling[0]["detokenize"]
    # the same prompt in another batch, alone (another rank's share): the same seeds
    _, alone = request_rows([[3]], [1], params, eos_id=2)
    assert alone[0]["seed"] == sampling[2]["seed"]
    assert all(0 <= s["seed"] < 1 << 63 for s in sampling)


def test_requests_ignore_eos_stops_on_nothing():
    params = SamplingParams(stop_token_ids=(9,), ignore_eos=True)
    (_, sampling) = request_rows([[1, 2]], [1], params, eos_id=2)
    assert sampling[0]["ignore_eos"] and sampling[0]["stop_token_ids"] == []  # as HFEngine and SGLang
    assert not request_rows([[1, 2]], [1], SamplingParams(), eos_id=2)[1][0]["ignore_eos"]


def test_requests_zero_samples_and_empty_prompt():
    assert request_rows([[1], [2]], [0, 0], SamplingParams(), eos_id=2) == ([], [])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        request_rows([[1], []], [1, 1], SamplingParams(), eos_id=2)
    with pytest.raises(ValueError, match="2 prompts but 1 sample counts"):
        request_rows([[1], [2]], [1], SamplingParams(), eos_id=2)


def _output(ids, logprobs, reason="stop", request_id="0"):
    steps = [{t: SimpleNamespace(logprob=lp), t + 1000: SimpleNamespace(logprob=-99.0)} for t, lp in zip(ids, logprobs)]
    return SimpleNamespace(request_id=request_id, outputs=[SimpleNamespace(token_ids=ids, logprobs=steps,
                                                                           finish_reason=reason)])


def test_parse_outputs_tokens_chosen_logprobs_reasons_and_grouping():
    outputs = [_output([5, 2], [-0.5, -0.25]), _output([7], [-1.0], "length"), _output([8, 2], [-2.0, -0.125])]
    (a, b), (c,) = parse_outputs(outputs, [2, 1])
    assert a.token_ids.tolist() == [5, 2] and a.logprobs.tolist() == [-0.5, -0.25] and a.finish_reason == "stop"
    assert b.finish_reason == "length" and b.logprobs.tolist() == [-1.0]
    assert c.token_ids.dtype == torch.long and c.logprobs.dtype == torch.float32


def test_parse_outputs_rejects_abort_count_mismatch_and_missing_logprobs():
    with pytest.raises(RuntimeError, match="ended with 'abort'"):
        parse_outputs([_output([5], [-1.0], "abort")], [1])
    with pytest.raises(RuntimeError, match="1 outputs for 2 requests"):
        parse_outputs([_output([5], [-1.0])], [2])
    broken = _output([5, 6], [-1.0, -2.0])
    broken.outputs[0].logprobs = broken.outputs[0].logprobs[:1]
    with pytest.raises(RuntimeError, match="1 log-probs for 2 tokens"):
        parse_outputs([broken], [1])


def test_fused_layers_are_never_split_across_reloads():
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert fusion_key(names[1]) == fusion_key(names[3]) == "model.layers.0.self_attn"
    tensors = [(n, torch.zeros(1)) for n in names]
    # a bucket ending inside the attention: q and k wait for v
    ready, held = split_complete(tensors[:3])
    assert [n for n, _ in ready] == names[:1] and [n for n, _ in held] == names[1:3]
    ready, held = split_complete(held + tensors[3:5])
    assert [n for n, _ in ready] == names[1:4] and [n for n, _ in held] == names[4:5]
    assert split_complete([]) == ([], [])


def test_engine_kwargs_fix_token_io_dummy_weights_and_processed_logprobs():
    kwargs = engine_kwargs("/m", torch.float32, seed=1, kv_cache_memory_bytes=1 << 20, gpu_memory_utilization=0.3,
                           max_model_len=None, enforce_eager=True, sleep=False, llm_args={"max_num_seqs": 8})
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["skip_tokenizer_init"]
    assert kwargs["load_format"] == "dummy" and kwargs["dtype"] == "float32"
    assert kwargs["kv_cache_memory_bytes"] == 1 << 20 and kwargs["max_num_seqs"] == 8
    assert "max_model_len" not in kwargs
    with pytest.raises(ValueError, match="llm_args.logprobs_mode is set by VLLMEngine"):
        engine_kwargs("/m", torch.float32, seed=1, kv_cache_memory_bytes=None, gpu_memory_utilization=0.3,
                      max_model_len=None, enforce_eager=False, sleep=False, llm_args={"logprobs_mode": "raw_logprobs"})


def test_missing_vllm_says_how_to_install(monkeypatch):
    from lit_rlvr.models.tiny import build_tiny

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    model, tokenizer = build_tiny(0, hidden_size=64, heads=2)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[vllm\]".*scripts/vllm_cpu_env.sh'):
        build_engine("vllm", model, tokenizer, {})


def test_engine_configs_compose():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        gpu, cpu = compose("config", overrides=["engine=vllm"]), compose("config", overrides=["engine=vllm_cpu"])
    assert gpu.engine.name == cpu.engine.name == "vllm"
    assert gpu.engine.options.kv_cache_memory_bytes is None and gpu.engine.options.sleep_level == 2
    assert cpu.engine.options.kv_cache_memory_bytes == 256 << 20 and cpu.engine.options.sleep_level == 0
