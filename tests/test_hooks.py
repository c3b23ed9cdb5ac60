"""RLVRCallback hook points: a callback changes the plan and the advantages as intended, inside a real step."""

import gc
from contextlib import contextmanager

import lightning.pytorch as pl
import pytest
import torch

from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.module import GRPOModule


class FixedBaseline(RLVRCallback):
    """Asks for 3 samples of prompt 0 and 5 of the others, and sets every group's baseline to 0.25."""

    def __init__(self):
        self.seen = {}

    def on_rollout_plan(self, trainer, pl_module, plan):
        plan.n_per_prompt = [3] + [5] * (plan.num_prompts - 1)

    def on_before_advantages(self, trainer, pl_module, rollouts):
        rollouts.baseline = torch.full((rollouts.num_groups,), 0.25)
        self.seen["rewards"] = rollouts.rewards.clone()
        self.seen["group"] = rollouts.group.clone()

    def loss_context(self, trainer, pl_module, rollouts, loss_pass):
        @contextmanager
        def record():
            self.seen["advantages"] = rollouts.advantages.clone()
            self.seen["passes"] = self.seen.get("passes", 0) + 1
            yield

        return record()

    def on_rl_step_end(self, trainer, pl_module, rollouts):
        self.seen["steps"] = self.seen.get("steps", 0) + 1
        self.seen["frozen_objects"] = gc.get_freeze_count()


def test_callback_sets_counts_and_baseline(tiny_path, tmp_path):
    callback = FixedBaseline()
    module = GRPOModule(model=tiny_path, group_size=4, max_new_tokens=6, scale_adv_by_std=False, lr=1e-4)
    data = RLVRDataModule(batch_size=4)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[callback], default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    counts = torch.bincount(callback.seen["group"], minlength=4)
    assert counts.tolist() == [3, 5, 5, 5]
    # A = r − b with b = 0.25 for every group (std scaling off), not r − group mean
    assert torch.allclose(callback.seen["advantages"], callback.seen["rewards"] - 0.25)
    assert callback.seen["passes"] == 1 and callback.seen["steps"] == 1
    # the set-up's objects are frozen during the run (no full-collection rescans) and released after it
    assert callback.seen["frozen_objects"] > 100_000 and gc.get_freeze_count() == 0


def test_objects_frozen_for_the_run_are_released_when_it_raises(tiny_path, tmp_path):
    class Raises(RLVRCallback):
        def on_rl_step_end(self, trainer, pl_module, rollouts):
            assert gc.get_freeze_count() > 0
            raise RuntimeError("boom")

    module = GRPOModule(model=tiny_path, group_size=2, max_new_tokens=4)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[Raises()], default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, datamodule=RLVRDataModule(batch_size=2))
    assert gc.get_freeze_count() == 0
