"""LoRA adapters on the policy (`model.lora.*`, whose settings are `lit_rlvr.config.settings.LoraOptions`): what
the rest of the library asks of a LoRA policy (its adapter parameters, the base model without them, its PEFT
config; the adapter is written in PEFT's format by `lit_rlvr.models.adapter_export`).

LoRA (Hu et al. 2021) replaces the update of a weight W [out, in] by a low-rank product:

    W' = W + (α / r) · B A          A [r, in] (random init), B [out, r] (zero init), r = rank, α = alpha

built with the `peft` library. Only A and B train, so the optimizer's state (AdamW's moments, IVON's posterior)
covers them alone; the frozen base serves as the KL reference with the adapter switched off. At step 0, B = 0 and
the LoRA policy computes exactly what the base model computes.

The default learning rate follows "LoRA Without Regret" (Schulman et al., Thinking Machines 2025): with α fixed
(32) the best LoRA learning rate hardly depends on the rank and is about 10x full fine-tuning's, in supervised
and in policy-gradient RL. `lr_scale` applies that factor to `algorithm.lr` (the full fine-tuning rate the
configs hold), so one `algorithm.lr` serves both; docs/lora.md has the tiny model's check of the rule.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D  # GPT-2's linear layer (weight [in, out]); peft adapts it as Linear

from lit_rlvr.config.extras import require
from lit_rlvr.config.problems import problem_line
from lit_rlvr.config.settings import LORA_KEY as KEY  # config path, for error messages
from lit_rlvr.config.settings import LoraOptions
from lit_rlvr.models import model_skeleton

ADAPTER_NAME = "default"  # peft's name of the one adapter we train
# The layer kinds an adapter may sit on: the ones every path of the library computes exactly (the loss forward,
# C3PO's stacked sampling in rollout/multi_weight.py, merged pushes, the PEFT export). peft can also adapt
# convolutions and nn.MultiheadAttention, whose adapters those paths would ignore or misapply: refused.
ADAPTABLE = {"Linear": nn.Linear, "Embedding": nn.Embedding, "Conv1D": Conv1D}


def target_problems(options: LoraOptions, model: Optional[nn.Module]) -> list[str]:
    """One line per target of `options` that names no module of `model` (peft's rule: the module's name is the
    target or ends in `.target`; peft itself only fails when no target matches at all) or names a module of a kind
    no adapter may sit on (`ADAPTABLE`). `model` may be a meta-device skeleton (`model_skeleton`); None = not known
    yet: nothing to say."""
    if model is None or not options.enabled or isinstance(options.target_modules, str):  # all-linear: peft picks
        return []
    modules = [(name, module) for name, module in model.named_modules() if name]
    kinds = tuple(ADAPTABLE.values())
    valid = ", ".join(sorted({n.rsplit(".", 1)[-1] for n, m in modules if isinstance(m, kinds)}))
    allowed = f"layers of the kinds {', '.join(ADAPTABLE)}"
    problems = []
    for target in options.target_modules:
        matches = [m for n, m in modules if n == target or n.endswith("." + target)]
        bad = sorted({type(m).__name__ for m in matches if not isinstance(m, kinds)})
        if not matches:
            problems.append(f"{KEY}.target_modules: {target!r} names no module of this model; valid: {valid}")
        elif bad:
            problems.append(f"{KEY}.target_modules: {target!r} names a {bad[0]} module; adapters sit on "
                            f"{allowed} only; valid: {valid}")
    return problems


def rank_problems(options: LoraOptions, model: Optional[nn.Module]) -> list[str]:
    """A rank above the model's width (its config's `hidden_size`): B A of rank r on a layer of width d has rank at
    most d, so a larger r only adds parameters (and memory: rank 1e9 asks for terabytes). `model` may be a skeleton;
    None or a config without `hidden_size`: nothing to say."""
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    if not options.enabled or not isinstance(width, int) or options.rank <= width:
        return []
    return [problem_line(f"{KEY}.rank", options.rank, f"an integer <= {width}, the model's width (hidden_size): a "
                                                      "higher rank adds parameters, not expressiveness")]


def lora_problems(options: LoraOptions, model: Optional[nn.Module]) -> list[str]:
    """`rank_problems` and `target_problems` of `options` on `model`."""
    return rank_problems(options, model) + target_problems(options, model)


def model_problems(options: LoraOptions, name_or_path: str, model_options: Optional[dict[str, Any]] = None
                   ) -> list[str]:
    """`lora_problems` before the model loads (no warm-up, engine or data yet): against the module tree its config
    builds on the meta device, when the config is at hand."""
    if not options.enabled:
        return []
    return lora_problems(options, model_skeleton(name_or_path, model_options))


def apply_lora(model: nn.Module, options: LoraOptions, seed: int = 0) -> nn.Module:
    """The policy with LoRA adapters (a `peft.PeftModel`): only the adapters require grad. `model` unchanged when
    LoRA is off. A's random init is drawn from `seed` (the run seed), not from wherever the global RNG stands, so
    the same seed builds the same adapter in any process, whatever ran before."""
    if not options.enabled:
        return model

    peft = require("peft")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model
    problems = lora_problems(options, model)
    if problems:
        raise ValueError(problems[0])
    targets = options.target_modules if isinstance(options.target_modules, str) else list(options.target_modules)
    config = LoraConfig(r=int(options.rank), lora_alpha=options.alpha, lora_dropout=options.dropout,
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = get_peft_model(model, config)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"{KEY}.target_modules={targets!r}: {err}") from None
    return peft_model


def is_lora(model: nn.Module) -> bool:
    """Whether `model` carries LoRA adapters (a peft model)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (its layers hold the adapters), else `model` itself."""
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) and is_lora(model) else model


def reference_model(policy: nn.Module, copy: Optional[nn.Module]) -> tuple[nn.Module, AbstractContextManager]:
    """The frozen KL reference and the context to score it in: the copy when there is one, else (LoRA) the policy
    itself with its adapter switched off (peft's `disable_adapter`): the base weights, no second copy."""
    if copy is not None or not is_lora(policy):
        return (copy if copy is not None else policy), nullcontext()
    return policy, policy.disable_adapter()


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates: the adapters with LoRA, all of them otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def peft_config_dict(model: nn.Module) -> dict[str, Any]:
    """The adapter's PEFT config as a JSON-able dict (what adapter_config.json holds)."""
    config = model.peft_config[ADAPTER_NAME]
    out = config.to_dict()
    if isinstance(out.get("target_modules"), set):
        out["target_modules"] = sorted(out["target_modules"])
    return out


def is_adapter_dir(path: Union[str, Path]) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def options_from_adapter(directory: Union[str, Path], lr_scale: float = 10.0) -> LoraOptions:
    """The `LoraOptions` that rebuild the adapter saved in `directory` (rank, alpha, targets, dropout)."""
    config = json.loads((Path(directory) / "adapter_config.json").read_text())
    targets = config.get("target_modules") or "all-linear"
    return LoraOptions(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                       target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
                       dropout=float(config.get("lora_dropout", 0.0)), lr_scale=lr_scale)


def load_adapter_weights(model: nn.Module, directory: Union[str, Path]) -> None:
    """Load the adapter tensors saved in `directory` (PEFT's format) into `model`'s adapter, in place; fails
    when a tensor is missing or has another shape."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(directory) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER_NAME)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint={str(directory)!r}: the adapter does not fit this model "
                         f"(missing {missing[:2]}, unexpected {list(result.unexpected_keys)[:2]})")


@torch.no_grad()
def merged_linear_weight(layer: nn.Module) -> Tensor:
    """W + (α / r)·B A of a peft LoRA layer, computed in fp32 and cast to W's dtype (the layer is not changed)."""
    base = layer.base_layer.weight
    delta = layer.get_delta_weight(ADAPTER_NAME)  # [out, in]
    return (base.float() + delta.float()).to(base.dtype)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of every peft LoRA layer (a `base_layer` plus A and B of our adapter): Linear and Conv1D
    layers hold A and B as `lora_A`/`lora_B` modules, Embedding layers as `lora_embedding_A`/`_B` parameters."""
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and any(ADAPTER_NAME in getattr(module, f"lora_{kind}A", {})
                                                 for kind in ("", "embedding_")):
            yield name, module


def lora_factor_names(layer_name: str, layer: nn.Module) -> tuple[str, str]:
    """The names of the layer's A and B among the policy's parameters."""
    if ADAPTER_NAME in getattr(layer, "lora_embedding_A", {}):
        return f"{layer_name}.lora_embedding_A.{ADAPTER_NAME}", f"{layer_name}.lora_embedding_B.{ADAPTER_NAME}"
    return f"{layer_name}.lora_A.{ADAPTER_NAME}.weight", f"{layer_name}.lora_B.{ADAPTER_NAME}.weight"


def lora_delta(layer: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """(α/r)·B A in fp32, laid out as the layer's base weight: [out, in] for Linear (A [r, in], B [out, r]);
    transposed for Conv1D ([in, out], peft's fan_in_fan_out) and Embedding ([V, d]; A [r, V], B [d, r])."""
    delta = layer.scaling[ADAPTER_NAME] * (b.float() @ a.float())
    transposed = ADAPTER_NAME in getattr(layer, "lora_embedding_A", {}) or getattr(layer, "fan_in_fan_out", False)
    return delta.T if transposed else delta


@contextmanager
def merged_adapter(model: nn.Module) -> Iterator[None]:
    """Inside, the adapter is merged into the base weights (W + (α/r)·B A, one matmul per layer, as a server
    without LoRA computes); on exit the base weights come back bit for bit. peft's own `unmerge_adapter`
    subtracts the delta again, which leaves rounding (~1e-8) in W: here the exact W is copied aside and restored."""
    saved = [(layer, layer.base_layer.weight.detach().clone()) for _, layer in lora_layers(model)]
    model.merge_adapter()
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, weight in saved:
                layer.base_layer.weight.copy_(weight)
                layer.merged_adapters = []  # peft's record that the layer holds a merge
