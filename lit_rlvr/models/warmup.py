"""Supervised warm-up of the tiny model on the arithmetic task, cached on disk by its settings.

RL needs a policy that is sometimes right: the warm-up stops early on purpose so held-out accuracy starts
well below 100% and RL has room to show gains.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

import torch

from lit_rlvr.data.tasks.arithmetic import ArithmeticTask
from lit_rlvr.models import tiny

try:
    import fcntl
except ImportError:  # pragma: no cover  (not POSIX)
    fcntl = None

log = logging.getLogger(__name__)


def sft_batch(tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+eos ids [B, L], attention mask [B, L], labels [B, L] (-100 off the answer)."""
    rows, label_rows = [], []
    for ex in examples:
        prompt = tokenizer(ex["prompt"])["input_ids"]
        target = tokenizer(str(ex["answer"]))["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        label_rows.append([-100] * len(prompt) + target)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, label_rows)):
        ids[i, : len(r)], labels[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), torch.tensor(lab), 1
    return ids, mask, labels


def warm_start_tiny(
    cache_dir: str | Path,
    *,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    levels: tuple[int, ...] = ArithmeticTask.levels,
    hidden_size: int = 64,
    layers: int = 2,
    split_seed: int = 0,
) -> Path:
    """Path of the warmed-up tiny model; trains and saves it unless the same settings are cached.

    It trains on the train split of `ArithmeticTask(seed=split_seed)`, the split the datamodule evaluates on
    (`data.split_seed`), so held-out problems are unseen whatever the model and run seeds. Several processes
    (torchrun ranks) may ask at once: the first takes a lock on the cache entry and trains, the others wait for
    it and load what it saved. It writes a temporary folder and renames it, so a half-written cache is never
    reused (and where the lock is unavailable, e.g. across hosts on some network filesystems, the first
    rename wins).
    """
    settings = dict(steps=steps, batch_size=batch_size, lr=lr, seed=seed, levels=list(levels),
                    hidden_size=hidden_size, layers=layers, split_seed=split_seed, version=2)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(cache_dir).expanduser() / f"tiny-{key}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(f"{path.name}.lock")):
        if (path / "config.json").exists():  # another process trained it while this one waited
            return path
        log.info("warm-starting the tiny model (%d supervised steps) into %s", steps, path)
        with torch.random.fork_rng(devices=[]):  # the caller's RNG must not depend on whether the cache was warm
            model, tokenizer = _train(steps, batch_size, lr, seed, levels, hidden_size, layers, split_seed)
        tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")  # unique on a shared filesystem
        tiny.save(model, tokenizer, tmp)
        try:
            tmp.rename(path)  # atomic: a half-written cache is never reused
        except OSError:  # another process finished the same warm-up first (same settings, same model)
            if not (path / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return path


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block; none where flock is not available."""
    with open(lock_path, "a") as handle:  # closing the file releases the lock
        if fcntl is not None:
            with suppress(OSError):  # a filesystem without flock: the rename still keeps the cache whole
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _train(steps: int, batch_size: int, lr: float, seed: int, levels: tuple[int, ...], hidden_size: int,
           layers: int, split_seed: int):
    """The supervised warm-up itself: (model, tokenizer) after `steps` AdamW steps on the train split."""
    model, tokenizer = tiny.build_tiny(seed, hidden_size=hidden_size, layers=layers)
    task = ArithmeticTask(levels=tuple(levels), seed=split_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max(steps, 1), pct_start=0.1)
    model.train()
    for step in range(steps):
        examples = [task.problem(step * batch_size + i, "train") for i in range(batch_size)]
        ids, mask, labels = sft_batch(tokenizer, examples)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    return model, tokenizer
