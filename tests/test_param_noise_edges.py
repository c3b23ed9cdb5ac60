"""Edges that scripts/mutation.py found unchecked (docs/mutation.md): each test kills named mutants."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.callbacks import ParamNoise
from lit_rlvr.optim import IVON
from lit_rlvr.rollout.batch import RolloutPlan

OPTIONS = dict(optimizer="ivon", group_size=4, ppo_epochs=1, mini_batches=1, seq_mask_tau=2.0)
TAU_WARNING = "without the sequence importance mask"


def _trainer():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    return SimpleNamespace(optimizers=[IVON([weight], lr=0.1, ess=1e3, hess_init=0.1, seed=0)])


def test_bf16_check_every_defaults_to_100():
    """The documented default of `bf16_check_every` (the signature's 100): checks at steps 0, 100, 200, ..."""
    assert ParamNoise().bf16_check_every == 100
    assert ParamNoise("b3po").bf16_check_every == 100


def test_one_ivon_step_per_rl_step_refuses_epochs_times_mini_batches_above_one():
    """3PO needs ppo_epochs × mini_batches = 1: 2 epochs of 2 mini-batches (a ratio of 1) are 4 IVON steps."""
    callback = ParamNoise("c3po", num_samples=2)
    callback.check_algorithm(AlgorithmConfig(**OPTIONS))
    with pytest.raises(ValueError, match="algorithm.ppo_epochs=1 and algorithm.mini_batches=1"):
        callback.check_algorithm(AlgorithmConfig(**dict(OPTIONS, ppo_epochs=2, mini_batches=2)))


def test_missing_sequence_mask_warns_once_per_callback(caplog):
    """The seq_mask_tau=null warning is given once, not at every options check."""
    callback = ParamNoise("c3po", num_samples=2)
    with caplog.at_level(logging.WARNING, logger="lit_rlvr.callbacks.param_noise"):
        callback.check_algorithm(AlgorithmConfig(**dict(OPTIONS, seq_mask_tau=None)))
        callback.check_algorithm(AlgorithmConfig(**dict(OPTIONS, seq_mask_tau=None)))
    assert sum(TAU_WARNING in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("sources, context", [(2, None), (1, lambda source: nullcontext())],
                         ids=["second-source-at-the-mean", "one-source-with-a-weight-context"])
def test_rollout_plan_refuses_either_kind_of_prior_weight_source_edit(sources, context):
    """3PO owns the weight sources: a plan another callback edited fails, whether it changed the number of sources
    alone or installed a weight context alone."""
    plan = RolloutPlan(["a"], [0], [[1]], [4], num_weight_sources=sources)
    if context is not None:
        plan.weight_context = context
    assert (plan.num_weight_sources != 1) != (not plan.uses_mean_weights)  # exactly one of the two edits
    with pytest.raises(RuntimeError, match="weight sources"):
        ParamNoise("c3po", num_samples=2).on_rollout_plan(_trainer(), None, plan)
