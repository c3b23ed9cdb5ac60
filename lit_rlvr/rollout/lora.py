"""What a LoRA policy's weight push sends (`WeightSync` in lit_rlvr.rollout.weight_sync makes the pushes), and the
post-push check that an engine samples the policy being trained.

What reaches an engine (`engine.options.lora_sync`):
* `shared` HF engine: nothing (it samples with the trainer's own modules, adapters included);
* `adapter` (default) on an engine that serves LoRA (`engine.serves_lora`: HF `copy`, vLLM, SGLang): the base
  weights once (while the engine holds none: at start, after a sleep that freed them), then per push only the
  adapter tensors, named with the weight version (`lit_rlvr_v{step}`, and `_s{j}` for 3PO's weight samples);
* `merged` (or an engine without LoRA): W + (α/r)·B A under the base model's HF names; all weights at first, then
  only the adapted layers (the others are frozen and the engine still holds them).

`check_engine_sync` guards against the silent failure verl users met (an adapter that never reached the engine,
rollouts from the initial policy for the whole run): after a push the engine samples a few tokens of a probe
prompt and the trainer scores the same tokens; `engine/sync_logp_diff` is the largest log-prob gap, and a gap
above the bound stops the run (`EngineSyncError`).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lit_rlvr.config.options import convert
from lit_rlvr.models.lora import ADAPTER_NAME, is_lora, lora_delta, lora_factor_names, lora_layers
from lit_rlvr.rollout.engine import EngineError, RolloutEngine, SamplingParams
from lit_rlvr.run.distributed import full_named_weights

LORA_SYNC = ("adapter", "merged")
ADAPTER_PREFIX = "lit_rlvr_v"


class EngineSyncError(EngineError):
    """The engine's log-probs disagree with the trainer's after a push: it is not sampling the trained policy."""


@dataclass(frozen=True)
class SyncCheck:
    """`engine.options.sync_check_tol`: the largest |engine − trainer| log-prob allowed after a push (None: 0.02
    for an fp32 engine, 0.5 for bf16/fp16, whose rounding alone moves log-probs by a few hundredths);
    `engine.options.sync_check_every`: check every k-th push (0 = never); `tokens`: tokens sampled per check."""

    tol: Optional[float] = None
    every: int = 1
    tokens: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "tol", convert("engine.options.sync_check_tol", self.tol, float, optional=True))
        object.__setattr__(self, "every", convert("engine.options.sync_check_every", self.every, int))
        if self.tol is not None and not self.tol > 0:
            raise ValueError(f"engine.options.sync_check_tol={self.tol!r} must be > 0, or null (by engine dtype)")
        if self.every < 0:
            raise ValueError(f"engine.options.sync_check_every={self.every!r} must be >= 0 (0 = off)")

    @classmethod
    def take_from(cls, engine_options: dict) -> "SyncCheck":
        """The check's settings, removed from `engine.options` (the rest configures the engine itself)."""
        tol, every = engine_options.pop("sync_check_tol", None), engine_options.pop("sync_check_every", 1)
        return cls(tol=tol, every=every)

    def bound(self, dtype: Optional[torch.dtype]) -> float:
        if self.tol is not None:
            return self.tol
        return 0.5 if dtype in (torch.bfloat16, torch.float16) else 0.02


def check_lora_sync(value: str) -> str:
    if value not in LORA_SYNC:
        raise ValueError(f"engine.options.lora_sync={value!r}; valid: {', '.join(LORA_SYNC)} (adapter: push LoRA "
                         "tensors to an engine that serves LoRA; merged: push W + BA under the base names)")
    return value


# -- names ----------------------------------------------------------------------------------------------------------
def hf_name(peft_name: str) -> str:
    """A base weight's name under peft -> the transformers model's: 'base_model.model.model.layers.0.mlp.up_proj.
    base_layer.weight' -> 'model.layers.0.mlp.up_proj.weight'."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def peft_file_name(param_name: str) -> str:
    """An adapter parameter's name -> its key in adapter_model.safetensors (peft drops the adapter's name, also
    at the end: an embedding adapter's `lora_embedding_A.default` is stored as `lora_embedding_A`)."""
    return re.sub(rf"\.{ADAPTER_NAME}(?=\.|$)", "", param_name)


def adapter_name(version: int, sample: Optional[int] = None, push: int = 0) -> str:
    """The engine-side name of an adapter: weight version `version`, then the push's count within that version
    (`_p{k}`: the mean, or one 3PO sample pushed alone), or 3PO's weight sample `sample` loaded for a
    multi-adapter call (`_s{j}`). Unique per push: an engine may cache an adapter by its name."""
    return f"{ADAPTER_PREFIX}{version}" + (f"_s{sample}" if sample is not None else f"_p{push}")


# -- what is pushed -------------------------------------------------------------------------------------------------
def adapter_tensors(policy: nn.Module, dtype: Optional[torch.dtype] = None) -> dict[str, Tensor]:
    """{PEFT file key: full tensor} of the adapter as the policy holds it now (a 3PO sample while one is in place)."""
    names = {n for n, p in policy.named_parameters() if p.requires_grad}
    return {peft_file_name(n): t for n, t in full_named_weights(policy, dtype) if n in names}


def base_named_weights(policy: nn.Module, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) of the frozen base weights, without the adapters."""
    for name, tensor in full_named_weights(policy, dtype):
        if ".lora_" not in name:
            yield hf_name(name), tensor


def merged_named_weights(policy: nn.Module, dtype: Optional[torch.dtype] = None, adapted_only: bool = False,
                         adapters: Optional[dict[str, Tensor]] = None) -> Iterator[tuple[str, Tensor]]:
    """(HF name, W + (α/r)·B A) of every weight the adapters change, computed in fp32 from the full tensors; with
    `adapted_only` False the unchanged base weights too (a first push). `adapters` ({parameter name: tensor}):
    A and B to merge instead of the policy's (a 3PO weight sample drawn earlier)."""
    full = dict(full_named_weights(policy))  # a collective under FSDP2: every rank gathers every tensor
    unknown = set(adapters or {}) - set(full)
    if unknown:  # merged silently from the policy's own adapters otherwise
        raise KeyError(f"merged_named_weights: {len(unknown)} adapter tensors that are not the policy's, e.g. "
                       f"{sorted(unknown)[0]!r}")
    full.update(adapters or {})
    layers = dict(lora_layers(policy))
    adapted = set()
    for layer_name, layer in layers.items():
        weight = full[f"{layer_name}.base_layer.weight"]
        a, b = (full[name] for name in lora_factor_names(layer_name, layer))
        merged = weight.float() + lora_delta(layer, a, b)  # W's shape: [out, in] for Linear
        adapted.add(f"{layer_name}.base_layer.weight")
        yield hf_name(f"{layer_name}.base_layer.weight"), merged.to(dtype or weight.dtype)
    if not adapted_only:
        for name, tensor in full.items():
            if ".lora_" not in name and name not in adapted:
                yield hf_name(name), tensor if dtype is None else tensor.to(dtype)


def merged_push_problems(engine: RolloutEngine, policy: nn.Module) -> list[str]:
    """Adapters a merged push cannot carry exactly, one line each: a layer whose base weight is tied to another
    module's (a tied `lm_head` / `embed_tokens`) holds one matrix in the engine, and W + ΔW there would change the
    other use too. Only for engines that receive merged weights (`lora_sync=merged`, or no LoRA serving)."""
    if engine.shares_weights or not is_lora(policy) or (engine.serves_lora and engine.lora_sync == "adapter"):
        return []
    holders: dict[int, list[str]] = {}
    for name, module in policy.named_modules(remove_duplicate=False):
        for pname, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append(hf_name(f"{name}.{pname}"))
    problems = []
    for layer_name, layer in lora_layers(policy):
        own = hf_name(f"{layer_name}.base_layer.weight")
        tied = sorted({n for n in holders[id(layer.base_layer.weight)] if n != own})
        if tied:
            target = layer_name.rsplit(".", 1)[-1]
            problems.append(f"model.lora.target_modules: {target!r} adapts a weight tied to {tied[0]}, which a merged "
                            f"push (engine.options.lora_sync={engine.lora_sync}) cannot change alone; use "
                            "engine=hf with engine.options.mode=shared, or leave it out of the targets")
    return problems


def push_bytes(policy: nn.Module, *, lora_sync: str, first: bool, dtype: Optional[torch.dtype] = None) -> int:
    """What one push sends, counted from the parameter shapes (no tensor is computed; works on the meta device)."""
    size = lambda p: p.numel() * (dtype.itemsize if dtype is not None else p.element_size())  # noqa: E731
    params = dict(policy.named_parameters())
    if not is_lora(policy):
        return sum(size(p) for p in params.values())
    adapters = sum(size(p) for n, p in params.items() if ".lora_" in n)
    base = sum(size(p) for n, p in params.items() if ".lora_" not in n)
    adapted = sum(size(layer.base_layer.weight) for _, layer in lora_layers(policy))
    if lora_sync == "adapter":
        return adapters + (base if first else 0)
    return base if first else adapted


# -- the post-push check --------------------------------------------------------------------------------------------
def probe_prompt(tokenizer) -> list[int]:
    """A short prompt every tokenizer can encode, for the post-push check."""
    ids = tokenizer("Question: 1 + 1 =", add_special_tokens=False)["input_ids"]
    return list(ids) or [tokenizer.eos_token_id]


@torch.no_grad()
def trainer_logprobs(policy: nn.Module, prompt: Sequence[int], tokens: Tensor,
                     temperature: float) -> tuple[Tensor, torch.dtype]:
    """[t] log-probs of `tokens` after `prompt` under softmax(logits / T) of the policy as it is now, and the dtype
    the logits were computed in (bf16 under FSDP's mixed precision, whatever the weights' dtype)."""
    device = next(policy.parameters()).device
    ids = torch.tensor([list(prompt) + tokens.tolist()], device=device)  # [1, P+t]
    was_training = policy.training
    policy.eval()
    try:
        logits = policy(input_ids=ids).logits[0, len(prompt) - 1: -1]  # [t, V]
    finally:
        policy.train(was_training)
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, tokens.to(device)[:, None]).squeeze(-1).cpu(), logits.dtype  # [t]


def check_engine_sync(engine: RolloutEngine, policy: nn.Module, prompt: Sequence[int], *, check: SyncCheck,
                      version: int, adapter: Optional[str] = None) -> Tensor:
    """max |engine − trainer| log-prob of `check.tokens` tokens the engine samples after `prompt` (a detached
    scalar tensor); raises `EngineSyncError` above the bound. The trainer scores with the weights it holds now."""
    params = SamplingParams(temperature=1.0, max_new_tokens=check.tokens, ignore_eos=True, adapter=adapter,
                            seed=zlib.crc32(f"sync:{version}".encode()))
    (completion,), = engine.generate([list(prompt)], [1], params)
    if len(completion.token_ids) == 0:
        return torch.tensor(0.0)
    mine, computed_in = trainer_logprobs(policy, prompt, completion.token_ids, params.temperature)
    diff = (completion.logprobs.float() - mine).abs().max()
    # the coarser side sets the rounding: the engine's dtype, or the trainer's compute dtype (FSDP: bf16)
    engine_dtype = engine.generation_dtype() or next(policy.parameters()).dtype
    bound = max(check.bound(engine_dtype), check.bound(computed_in))
    if not bool(diff <= bound):
        raise EngineSyncError(
            f"after the weight push of step {version} the engine's log-probs differ from the trainer's by "
            f"{float(diff):.4g} (> engine.options.sync_check_tol={bound:g}) on {len(mine)} sampled tokens: the "
            f"engine is not sampling the policy being trained (a push that did not arrive, or arrived in part"
            f"{'; adapter ' + repr(adapter) if adapter else ''}); training on its rollouts would train a stale "
            "policy. If the gap is the engine's precision instead, raise engine.options.sync_check_tol")
    return diff.detach()
