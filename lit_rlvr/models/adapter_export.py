"""`AdapterExport`: with LoRA, every checkpoint save also writes the adapter alone, in PEFT's format, to
`adapter/` in the checkpoint's folder (docs/lora.md), whatever saved it: train.py's `RunCheckpoint`, the
Lightning CLI's `ModelCheckpoint`, a `trainer.save_checkpoint` call. `GRPOModule.configure_callbacks` adds it,
so every entry point writes the same files.

Why the strategy's `save_checkpoint` is wrapped: Lightning has no hook after a checkpoint is written, and
`on_save_checkpoint` is not told where it goes; the strategy's method is called on every rank with the path,
for one file and for a sharded folder alike (the adapter export is a collective under FSDP2).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import lightning.pytorch as pl
from torch import Tensor, nn
from typing_extensions import override

from lit_rlvr.models.lora import is_lora
from lit_rlvr.run.distributed import full_named_weights

FOLDER = "adapter"


def adapter_dir(checkpoint_path: Any) -> Path:
    """Where the adapter of a checkpoint saved at `checkpoint_path` goes: `adapter/` beside it."""
    return Path(checkpoint_path).parent / FOLDER


class AdapterExport(pl.Callback):
    """Writes the policy's LoRA adapter beside every checkpoint the trainer saves (nothing without LoRA)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        save = strategy.save_checkpoint
        if getattr(save, "exports_adapter", False):  # set up before (fit, then validate, on one trainer)
            return

        def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
            save(checkpoint, filepath, storage_options=storage_options)
            policy = getattr(trainer.lightning_module, "policy", None)
            if policy is not None and is_lora(policy):  # after the checkpoint: a failed save writes no adapter
                save_adapter(policy, adapter_dir(filepath), is_main_process=trainer.is_global_zero)

        save_checkpoint.exports_adapter = True
        strategy.save_checkpoint = save_checkpoint  # kept after fit: train.py saves once more after it returns


def adapter_state(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name in `model.named_parameters()`, full tensor) of each adapter parameter; FSDP2 shards are gathered."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    yield from ((n, t) for n, t in full_named_weights(model) if n in names)


def save_adapter(model: nn.Module, directory: Union[str, Path], *, is_main_process: bool = True) -> Path:
    """Write the adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`) so that
    `PeftModel.from_pretrained(base, directory)` loads it. A collective under FSDP2 (shards are gathered on every
    rank); only the main process writes. Written to a sibling folder and renamed in: a reader never sees half."""
    directory = Path(directory)
    state = dict(adapter_state(model))  # every rank: full_tensor is a collective
    if not is_main_process:
        return directory
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), state_dict={k: v.detach().cpu().contiguous() for k, v in state.items()})
    aside = directory.with_name(directory.name + ".old")
    shutil.rmtree(aside, ignore_errors=True)
    if directory.exists():
        os.replace(directory, aside)
    os.replace(tmp, directory)
    shutil.rmtree(aside, ignore_errors=True)
    return directory
