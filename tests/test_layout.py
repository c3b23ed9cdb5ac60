"""Issue 22's layout rules, checked on the source: one owner per concern, the engine contract explicit."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import types
from pathlib import Path

import pytest

from lit_rlvr.callbacks import ValuePrior
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.rollout.engine import RolloutEngine

ROOT = Path(__file__).resolve().parents[1]
PROBE = re.compile(r"\b(hasattr|getattr)\(\s*[\w.]*engine\b")


def test_no_engine_probes_outside_the_engines_package():
    """A third engine learns its contract from `RolloutEngine`, not from `hasattr` calls in its callers."""
    files = [p for p in (ROOT / "lit_rlvr").rglob("*.py") if "rollout" not in p.relative_to(ROOT / "lit_rlvr").parts]
    files += list((ROOT / "callbacks").glob("*.py"))
    probes = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
              for i, line in enumerate(p.read_text().splitlines(), 1) if PROBE.search(line)]
    assert probes == []


def test_the_engine_contract_has_defaults_for_all_but_generation_and_weights():
    class Minimal(RolloutEngine):
        def generate(self, prompt_token_ids, n_per_prompt, params):
            return [[] for _ in prompt_token_ids]

        def load_weights(self, named_tensors):
            self.loaded = list(named_tensors)

    engine = Minimal()
    engine.sleep(), engine.wake(), engine.end_weight_update(), engine.shutdown()
    assert engine.to("cpu") is engine and engine.version == 0 and engine.generation_dtype() is None
    assert not engine.shares_weights and not engine.can_generate_stacked and engine.weight_dtype is None


def test_module_and_training_step_stay_short():
    source = (ROOT / "lit_rlvr" / "module.py").read_text()
    assert len(source.splitlines()) < 480
    step = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "training_step")
    assert step.end_lineno - step.lineno + 1 < 25


def test_the_batch_carries_per_step_data_only():
    """Loss options (`scale_adv_by_std`, `seq_mask_tau`) are the module's; the batch holds no copy of them."""
    names = {f.name for f in dataclasses.fields(Rollouts)}
    assert not names & {"scale_adv_by_std", "seq_mask_tau", "chunk"} and "source" in names
    assert {"scale_adv_by_std", "seq_mask_tau"} <= set(inspect.signature(GRPOModule.__init__).parameters)


def test_seq_mask_tau_is_checked_by_the_module():
    with pytest.raises(ValueError, match=r"algorithm\.seq_mask_tau=1\.0"):
        GRPOModule(seq_mask_tau=1.0)  # fails in the option checks, before the model loads


def test_k_init_follows_the_module_group_size():
    module = types.SimpleNamespace(hparams={"group_size": 6, "scale_adv_by_std": False})
    callback = ValuePrior(value_model=object())  # a ready V0: setup builds nothing
    callback.setup(None, module, "fit")
    assert callback.k_init == 6
    explicit = ValuePrior(k_init=2, value_model=object())
    explicit.setup(None, module, "fit")
    assert explicit.k_init == 2
