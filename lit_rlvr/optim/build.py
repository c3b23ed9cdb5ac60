"""`build_optimizer`: the RL step's optimizer from its config name, and the checks that keep IVON meaningful.

`check_optimizer_options` runs when the module is built (before any work); `build_optimizer` when Lightning
configures optimizers (the parameters are placed, and sharded under FSDP2, by then)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Iterable, Optional

import torch

from lit_rlvr.config.settings import OptimConfig
from lit_rlvr.optim.ivon import IVON
from lit_rlvr.optim.schedule import warmup_factor
from lit_rlvr.run.one_line import config_phase

OPTIMIZERS = ("adamw", "ivon")
IVON_EXTRA_OPTIONS = {"sync", "debias"}  # taken by ivon-opt's constructor through **kwargs


def check_optimizer_options(name: str, options: Optional[dict[str, Any]], *, lr: float, grad_clip: float,
                            weight_decay: float, dtype: str) -> None:
    """Fail on a choice that cannot work, naming the `algorithm.` key to change."""
    if name not in OPTIMIZERS:
        raise ValueError(f"algorithm.optimizer={name!r}; valid: {', '.join(OPTIMIZERS)}")
    if name == "ivon":
        check_ivon_options(dict(options or {}), lr=lr, grad_clip=grad_clip, weight_decay=weight_decay, dtype=dtype)


def check_ivon_options(options: dict[str, Any], *, lr: float, grad_clip: float, weight_decay: float,
                       dtype: str) -> None:
    if grad_clip or weight_decay:
        # IVON records each sample's gradient before the module could clip it, and its δ sets σ
        raise ValueError("with algorithm.optimizer=ivon set algorithm.grad_clip=0 and algorithm.weight_decay=0; "
                         "IVON bounds its step by optimizer_options.clip_radius and takes δ from "
                         "optimizer_options.weight_decay")
    valid = set(inspect.signature(IVON.__init__).parameters) - {"self", "params", "lr", "seed", "rank", "kwargs"}
    unknown = set(options) - valid - IVON_EXTRA_OPTIONS
    if unknown or "ess" not in options:
        raise ValueError(f"algorithm.optimizer_options for ivon: ess (λ) is required; unknown keys "
                         f"{sorted(unknown)}; valid: {', '.join(sorted(valid | IVON_EXTRA_OPTIONS))}")
    if not float(options["ess"]) > 0 or not lr > 0:
        raise ValueError(f"algorithm.optimizer_options.ess and algorithm.lr must be > 0 for ivon, got "
                         f"{options['ess']} and {lr}")
    if options.get("hess_approx", "price") not in IVON.hessian_approx_methods:
        raise ValueError(f"algorithm.optimizer_options.hess_approx={options['hess_approx']!r}; valid: "
                         f"{', '.join(IVON.hessian_approx_methods)}")
    if options.get("mc_samples", 1) != 1:
        # ivon-opt repeats a closure that returns the loss; Lightning's manual optimization passes none
        raise ValueError(f"algorithm.optimizer_options.mc_samples={options['mc_samples']}: one gradient sample "
                         "is recorded per loss pass; for several weight samples per step use algorithm=m3po "
                         "(algorithm.callbacks.param_noise.num_samples)")
    if dtype != "float32":
        # the mean moves by at most lr·(h0 + δ)·clip_radius per step (1e-6 at c3po_paper's settings), far below
        # the spacing of bf16 numbers near typical weights (~1e-4): bf16 weights would round every update away
        raise ValueError(f"algorithm.optimizer=ivon needs model.dtype=float32 (got {dtype!r}): IVON's mean "
                         "updates are smaller than the spacing of half-precision weights, which would never "
                         "change. Compute can still run in bf16: trainer=gpu (bf16-mixed) or trainer=fsdp "
                         "(trainer.strategy.param_dtype=bfloat16)")


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
                    weight_decay: float, options: Optional[dict[str, Any]], seed: int, rank: int, world_size: int,
                    strategy: str) -> torch.optim.Optimizer:
    """AdamW, or IVON seeded by the run seed and the rank. `strategy`: the trainer's strategy class name (IVON
    on several ranks needs FSDP2's sharded parameters: `FSDP2Strategy`)."""
    options = dict(options or {})
    params = list(params)
    if name == "ivon":
        sharded = any(hasattr(p, "full_tensor") for p in params)  # DTensor shards: each rank perturbs its own
        if world_size > 1 and not sharded:
            # each DDP rank would pair its own noise with the averaged gradient: their Hessians, then their
            # weights, drift apart; FSDP2 perturbs each shard once, on the rank that holds it
            raise ValueError(f"algorithm.optimizer=ivon on {world_size} ranks needs trainer=fsdp "
                             f"(or fsdp32); this run's strategy is {strategy}")
        # run seed and rank seed the weight samples: reproducible, resumable, different per data-parallel rank
        return IVON(params, lr=lr, seed=seed, rank=rank, **options)
    # the fused kernel: one call for all tensors (~3x faster than the per-tensor loop on a small model);
    # sharded (DTensor) parameters keep torch's own choice
    options.setdefault("fused", not any(hasattr(p, "full_tensor") for p in params) or None)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, **options)


def optimizer_and_schedule(optim: OptimConfig, params: Iterable[torch.nn.Parameter], *, lr: float, seed: int,
                           rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    """Lightning's `configure_optimizers` answer: `optim.optimizer` built at `lr` (`build_optimizer`; LoRA scales
    the lr) with its linear warm-up, stepped after every optimizer step."""
    with config_phase():  # the optimizer's own checks (torch: "Invalid learning rate") are config errors
        optimizer = build_optimizer(optim.optimizer, params, lr=lr, betas=optim.betas,
                                    weight_decay=optim.weight_decay, options=optim.optimizer_options, seed=seed,
                                    rank=rank, world_size=world_size, strategy=strategy)
    factor = functools.partial(warmup_factor, warmup_steps=optim.warmup_steps, from_zero=optim.warmup_from_zero)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
