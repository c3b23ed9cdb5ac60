"""docs/write_your_own_loss.md: the worked example's code runs, matches the doc's hand numbers, and trains."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lit_rlvr.data.datamodule import RLVRDataModule
from tiny_options import TINY as TINY_OPTIONS

DOC = Path(__file__).resolve().parents[1] / "docs" / "write_your_own_loss.md"
TINY = {"cache_dir": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr"), **TINY_OPTIONS}  # = conf/model/tiny.yaml


@pytest.fixture(scope="module")
def my_losses(tmp_path_factory):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "the doc should hold exactly one python block (the example the test runs)"
    path = tmp_path_factory.mktemp("doc") / "my_losses.py"
    path.write_text(blocks[0])
    spec = importlib.util.spec_from_file_location("my_losses", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["my_losses"] = module  # as `PYTHONPATH=. ... my_losses.ReinforceModule` would import it
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("my_losses", None)


def test_doc_hand_numbers(my_losses):
    adv, _ = my_losses.rloo_advantages(torch.tensor([1.0, -1.0, -1.0]), torch.tensor([0, 0, 0]), 1)
    assert adv.tolist() == pytest.approx([2.0, -1.0, -1.0])
    logp = torch.tensor([[-0.5]], requires_grad=True)
    old = torch.tensor([[-0.5 - math.log(3.0)]])  # ratio 3, truncated to 2
    loss, metrics = my_losses.truncated_is_reinforce(logp, old, torch.tensor([2.0]), torch.tensor([[True]]),
                                                     max_weight=2.0, aggregation="token-mean", norm_len=8)
    assert loss.item() == pytest.approx(2.0)  # −(min(3, 2)·2·(−0.5))
    assert metrics["loss/is_truncated_frac"].item() == 1.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(-4.0)  # the weight carries no gradient: d/dlogp = −c·A


class LastMetrics(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics = {k: float(v) for k, v in pl_module.step_metrics.items()}


def test_doc_example_trains_two_steps(my_losses):
    pl.seed_everything(0, verbose=False)
    module = my_losses.ReinforceModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=8,
                                       lr=2e-4, max_is_weight=2.0)
    assert module.max_is_weight == 2.0 and module.hparams.max_is_weight == 2.0
    before = [p.detach().clone() for p in module.policy.parameters()]
    last = LastMetrics()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[last])
    trainer.fit(module, datamodule=RLVRDataModule(batch_size=4, seed=0))
    assert trainer.global_step == 2
    assert {"adv/abs_mean", "loss/is_truncated_frac", "loss/policy", "grad/norm"} <= set(last.metrics)
    assert all(math.isfinite(v) for v in last.metrics.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    with pytest.raises(ValueError, match="algorithm.max_is_weight"):
        my_losses.ReinforceModule(model="tiny", model_options=dict(TINY), max_is_weight=0.5)


def test_the_docs_algorithm_yaml_with_the_subclass_argument_composes(my_losses, tmp_path):
    """The doc's `conf/algorithm/reinforce.yaml` (a subclass's own key beside the settings) composes through train.py's
    check, and its key reaches the subclass; a misspelt key in such a file is still one line naming it."""
    from lit_rlvr.app.entry import compose_checked
    from lit_rlvr.app.recipe import module_arguments

    recipe = re.search(r"```yaml\n(defaults:.*?)```", DOC.read_text(), flags=re.S).group(1)
    (tmp_path / "algorithm").mkdir()
    (tmp_path / "algorithm" / "reinforce.yaml").write_text(recipe)
    (tmp_path / "algorithm" / "typo.yaml").write_text("defaults:\n  - grpo\n  - _self_\nname: typo\nlrr: 1.0\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    args = module_arguments(compose_checked(None, [search, "algorithm=reinforce"]))
    assert args["_target_"] == "my_losses.ReinforceModule" and args["max_is_weight"] == 2.0
    from lit_rlvr.app.config_check import check_config
    from lit_rlvr.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm\.lrr is not an option \(did you mean algorithm\.lr\?\)"):
        check_config(compose_checked(None, [search, "algorithm=typo"]))
