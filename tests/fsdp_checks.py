"""A test-only callback for the FSDP runs of tests/test_fsdp.py (added with `+callbacks.push_check=...`).

After every weight push it checks, on each rank, that the engine holds exactly the gathered trainer weights,
and records a digest of the engine's weights so the test can compare ranks. With IVON (3PO) it also checks
that a pushed weight sample equals m + σ⊙ε, ε drawn shard by shard from the documented seeds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.optim.ivon import IVON, sample_seed


def _full(param: torch.Tensor) -> torch.Tensor:
    t = param.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class PushCheck(RLVRCallback):
    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)
        self.records: list[dict] = []
        self.means: dict[str, torch.Tensor] = {}
        self.samples_pushed = 0

    def on_validation_start(self, trainer, pl_module) -> None:
        self._wrap(pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._wrap(pl_module)

    def _wrap(self, pl_module) -> None:
        """Check every push of the run: the driver (built in the module's setup) sends them all through `push`."""
        driver = pl_module.driver
        if getattr(driver.push, "checked", False):  # a run validates, fits, validates: wrap once
            return
        original = driver.push

        def checked_push(**kwargs):
            seconds = original(**kwargs)
            self._check(pl_module)
            return seconds

        checked_push.checked = True
        driver.push = checked_push

    def on_rollout_plan(self, trainer, pl_module, plan) -> None:
        self.means = {n: _full(p).clone() for n, p in pl_module.policy.named_parameters()}  # m, before any sample
        self.samples_pushed = 0

    def _check(self, pl_module) -> None:
        engine_params = dict(pl_module.engine.model.named_parameters())
        exact, digest = True, hashlib.sha256()
        for name, param in pl_module.policy.named_parameters():
            full = _full(param)
            exact &= torch.equal(engine_params[name].detach(), full)
            digest.update(engine_params[name].detach().cpu().numpy().tobytes())
        record = {"step": pl_module.global_step, "exact": bool(exact), "digest": digest.hexdigest()}
        optimizers = pl_module.optimizers() if pl_module._trainer is not None else []  # [] while validating only
        optimizer = getattr(optimizers, "optimizer", None)
        if isinstance(optimizer, IVON) and optimizer._runtime["sampling"]:
            record["sample_index"] = self.samples_pushed
            record["noise_max_err"] = self._noise_error(pl_module, optimizer, self.samples_pushed)
            self.samples_pushed += 1
        self.records.append(record)

    def _noise_error(self, pl_module, optimizer: IVON, sample_index: int) -> float:
        """max |engine weight − (m + σ⊙ε)| with ε rebuilt from (seed, step, sample, shard, param index)."""
        from torch.distributed.tensor import DTensor

        engine_params = dict(pl_module.engine.model.named_parameters())
        names = {id(p): n for n, p in pl_module.policy.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        worst = 0.0
        for index, (param, sigma) in enumerate(zip(params, optimizer.sigma())):  # σ: shaped like the local shard
            local = param.to_local() if isinstance(param, DTensor) else param
            gen = torch.Generator().manual_seed(sample_seed(optimizer.seed, optimizer.current_step, sample_index,
                                                            optimizer._shard_key(param), index))
            noise = sigma * torch.randn(local.numel(), generator=gen).view(local.shape)
            if isinstance(param, DTensor):
                noise = DTensor.from_local(noise, param.device_mesh, param.placements, shape=param.shape,
                                           stride=param.stride()).full_tensor()
            name = names[id(param)]
            worst = max(worst, float((engine_params[name].detach() - (self.means[name] + noise)).abs().max()))
        return worst

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """After each of a run's trainer calls (`mode=eval` only validates): every push so far."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"push_check_rank{rank}.json").write_text(json.dumps(self.records))
