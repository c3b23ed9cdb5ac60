"""A test-only callback for the live `train.py engine=sglang_cpu` runs (added with `+callbacks.push_probe=...`).

After every weight push it records the step, whether the push holds the mean weights (3PO pushes one weight
sample at a time), a digest of the pushed policy weights, and the engine's greedy answer to one probe prompt,
which shows the live engine serves those weights. `push_probe_rank{R}.json` is rewritten after each push.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.rollout.engine import SamplingParams

PROBE = "12+34="


class PushProbe(RLVRCallback):
    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)
        self.records: list[dict] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.path = self.out_dir / f"push_probe_rank{trainer.global_rank}.json"

    def on_validation_start(self, trainer, pl_module) -> None:
        self._wrap(pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._wrap(pl_module)

    def _wrap(self, pl_module) -> None:
        """Record every push: the driver (built in the module's setup) sends them all through `push`. The training
        step's push (`RolloutSource.push`) is answered once it has returned: with partial rollouts it is staged while
        the producer generates, and lands in the engine's next generation (the probe's, if none comes first)."""
        driver = pl_module.driver
        if getattr(driver.push, "probed", False):  # a run validates, fits, validates: wrap once
            return
        original, source_push, pending = driver.push, pl_module.source.push, []

        def probed_push(*, step: int, holds_mean: bool = True):
            seconds = original(step=step, holds_mean=holds_mean)
            record = self._record(pl_module, holds_mean)
            if pending:  # inside the source's push: answered after it
                pending.append(record)
            else:
                self._answer(pl_module, [record])
            return seconds

        def probed_source_push():
            pending.append(None)
            try:
                metrics = source_push()
            finally:
                records = [r for r in pending if r is not None]
                pending.clear()
            self._answer(pl_module, records)
            return metrics

        probed_push.probed = True
        driver.push, pl_module.source.push = probed_push, probed_source_push

    @torch.no_grad()
    def _record(self, pl_module, holds_mean: bool) -> dict:
        digest = hashlib.sha256()
        for name, param in pl_module.policy.named_parameters():
            digest.update(name.encode())
            full = param.detach().full_tensor() if hasattr(param, "full_tensor") else param.detach()  # FSDP2 shards
            digest.update(full.float().cpu().numpy().tobytes())
        return {"step": pl_module.global_step, "holds_mean": holds_mean, "digest": digest.hexdigest()}

    def _answer(self, pl_module, records: list[dict]) -> None:
        """The engine's greedy answer to the probe prompt, between two of the producer's batches in async mode."""
        if not records:
            return
        prompt = pl_module.tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        with pl_module.source.engine_access():
            (probe,) = pl_module.engine.generate([prompt], [1], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
        for record in records:
            record.update(probe_ids=probe.token_ids.tolist(), probe_logprobs=probe.logprobs.tolist())
        self.records += records
        self.path.write_text(json.dumps(self.records))
