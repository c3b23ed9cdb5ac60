"""Every shipped algorithm trains LoRA adapters (`model.lora.rank`): two short RL steps each, composed from conf/
as `python train.py algorithm=NAME model.lora.rank=4` composes them. After them the adapters have moved, the
base weights are bit for bit what they were, and 3PO's weight noise was drawn over the adapters alone."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lit_rlvr.app.recipe import build_module
from tiny_options import REPO

SMALL = ["data.batch_size=2", "algorithm.max_new_tokens=4", "data.num_test=4", "model.lora.rank=4"]
ALGORITHMS = {
    "grpo": ["algorithm.group_size=4"], "dapo": ["algorithm.group_size=4"], "dr_grpo": ["algorithm.group_size=4"],
    "gspo": ["algorithm.group_size=4"], "b3po": ["algorithm.group_size=4"], "c3po": ["algorithm.group_size=4"],
    "m3po": ["algorithm.group_size=8"],  # G/N >= 2
    "v05": ["algorithm.callbacks.value_prior.min_context=2", "algorithm.callbacks.value_prior.k_max=6",
            "algorithm.callbacks.value_prior.pad_to=1"],
    "c3po_v05": ["algorithm.callbacks.value_prior.min_context=2", "algorithm.callbacks.value_prior.k_max=8",
                 "algorithm.callbacks.value_prior.pad_to=1"],
}


def run(name: str, steps: int = 2, extra: tuple[str, ...] = ()):
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"algorithm={name}", "~logger", "callbacks.progress=null", *SMALL,
                                           *ALGORITHMS[name], *extra])
    pl.seed_everything(cfg.seed, verbose=False)
    callbacks = [instantiate(n) for n in (cfg.algorithm.get("callbacks") or {}).values() if n is not None]
    kwargs = {**OmegaConf.to_container(cfg.trainer, resolve=True), "max_steps": steps, "limit_val_batches": 0}
    trainer = pl.Trainer(**kwargs, logger=False, callbacks=callbacks, enable_checkpointing=False,
                         enable_progress_bar=False)
    module = build_module(cfg)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    rows = []
    real = module._log_step
    module._log_step = lambda *a: (real(*a), rows.append(dict(module.step_metrics)))[0]
    trainer.fit(module, datamodule=instantiate(cfg.data))
    return module, trainer, before, rows


@pytest.mark.parametrize("name, extra", [*((n, ()) for n in sorted(ALGORITHMS)),
                                         ("c3po", ("model.compile=true",))],
                         ids=[*sorted(ALGORITHMS), "c3po-compiled"])
def test_algorithm_trains_adapters_only(name, extra):
    """`c3po-compiled`: IVON's weight noise on the adapters, the update through torch.compile (model.compile)."""
    module, trainer, before, rows = run(name, extra=extra)
    assert ("policy" in module._compiled) == bool(extra)
    assert rows and all(torch.isfinite(r["loss/policy"]) for r in rows)  # gspo: 2 optimizer steps per RL step
    moved = {n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert moved and moved <= adapters, sorted(moved - adapters)[:3]  # the base never changes
    adapter_numel = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
    if "noise/numel" in rows[-1]:  # 3PO: the posterior and its draws cover the adapters alone
        assert float(rows[-1]["noise/numel"]) == adapter_numel
        assert float(rows[-1]["noise/param_delta_rms"]) > 0
    optimizer = trainer.optimizers[0]
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == adapter_numel
