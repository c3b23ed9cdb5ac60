"""Loading policies: the built-in tiny model (warm-started, cached) or any HF causal LM path."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lit_rlvr.models.tiny import build_tokenizer, tiny_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_option_names() -> list[str]:
    """`model.options` of the built-in tiny model (its warm-up's arguments), besides `cache_dir`."""
    from lit_rlvr.models.warmup import warm_start_tiny

    return [k for k in inspect.signature(warm_start_tiny).parameters if k != "cache_dir"]


def resolve_model_path(name_or_path: str, options: dict[str, Any] | None = None) -> str:
    """`tiny` -> the warm-started tiny model (built on first use); anything else is an HF path or hub name."""
    options = dict(options or {})
    if name_or_path == "tiny":
        from lit_rlvr.models.cache_entry import default_cache_dir
        from lit_rlvr.models.warmup import warm_start_tiny

        cache_dir = options.pop("cache_dir", None)  # "" stays "": an empty LIT_RLVR_CACHE is refused, not the cwd
        cache_dir = default_cache_dir() if cache_dir is None else cache_dir
        valid = tiny_option_names()
        unknown = sorted(set(options) - set(valid))
        if unknown:  # e.g. `steps` from before the warm-up stopped at a target accuracy
            raise ValueError(f"model.options.{unknown[0]} is not an option of the tiny model; "
                             f"valid: {', '.join(valid)}")
        return str(warm_start_tiny(cache_dir, **options))
    local = Path(name_or_path).expanduser()
    if name_or_path.startswith((".", "/", "~")) and not local.exists():
        raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: no such directory")
    return str(local) if local.exists() else name_or_path


def load_policy(path: str, dtype: str = "float32"):
    """(model, tokenizer) from an HF directory or hub name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is not valid; valid: {', '.join(DTYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
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
