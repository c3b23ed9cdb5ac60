"""Loading policies: an HF causal LM path (the built-in tiny model resolves to one: `lit_rlvr.rollout.warmup`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lit_rlvr.models.tiny import build_tokenizer, tiny_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(path: str, dtype: str = "float32"):
    """(model, tokenizer) from an HF directory or hub name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is not valid; valid: {', '.join(DTYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    without_hub_kernels(model)
    return model, tokenizer


def model_skeleton(name_or_path: str, options: Optional[dict[str, Any]] = None) -> Optional[nn.Module]:
    """The model's module tree on the meta device, built from its config alone (no weights, no warm-up, no
    download), for checks that need its module names before any work (`LoraOptions.target_problems`). None when
    the config is not at hand (a hub name outside the local cache, an architecture transformers cannot build):
    the loaded model is checked instead."""
    from transformers import AutoConfig, AutoModelForCausalLM

    options = options or {}
    try:
        if name_or_path == "tiny":
            shape = {k: options[k] for k in ("hidden_size", "layers") if k in options}
            config = tiny_config(len(build_tokenizer()), **shape)
        else:
            config = AutoConfig.from_pretrained(str(Path(name_or_path).expanduser()), local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # an early check only: whatever fails here fails again, with its own message, at load
        return None


def without_hub_kernels(model) -> None:
    """Turn off transformers' hub kernels (on by default in `from_pretrained` since transformers 5.25 when the
    `kernels` package is installed): with them, every `train()`/`eval()` switch re-kernelizes the model, which
    replaces the forward of its norm layers. That would undo a forward patched for the duration of a call (C3PO's
    stacked sampling patches the norms'), and hub kernels may be fetched from the network."""
    if getattr(model, "use_kernels", False):
        model.use_kernels = False  # resets the kernelized forwards to the model's own

