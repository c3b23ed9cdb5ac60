"""`RLVRCallback`: a Lightning `Callback` with the RL hook points of one step (docs/architecture.md §3).

The module calls these hooks on every callback of the trainer that is an `RLVRCallback`, in trainer order.
Two callbacks that edit the plan must compose: edit what you need, keep what others set.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Iterable, Optional

from lightning.pytorch.callbacks import Callback

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import group_size_problem
from lit_rlvr.config.settings import AlgorithmConfig, RolloutConfig
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from lit_rlvr.rollout.source import async_refusals

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl


class RLVRCallback(Callback):
    # True for a callback that sets each prompt's sample count itself (V0.5): the module's group_size is unused
    sets_sample_counts = False
    # why this callback cannot run with rollout.mode=async (None: it can): the producer plans and generates the
    # next batches while this step's hooks still run
    async_refusal: Optional[str] = None
    # True for a callback that sets `rollouts.baseline` (V0.5's fusion, DBB's history): two cannot run together
    sets_baseline = False

    def check_algorithm(self, algorithm: AlgorithmConfig) -> None:
        """The module's algorithm settings (`group_size`, `optimizer`, …), before any work: raise a ValueError naming
        the config key when this callback cannot work with them, or take a default from them.
        Called by train.py before the model loads and again by the module's `setup` (say a warning once)."""

    def on_rollout_plan(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", plan: RolloutPlan) -> None:
        """Before any rollout: change counts, weight sources or the budget rule of `plan` in place."""

    def on_before_advantages(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        """After rewards, before advantages: e.g. set `rollouts.baseline` ([B]) or `rollouts.loss_pass`."""

    def loss_context(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts, loss_pass: int
    ) -> AbstractContextManager:
        """Context around the forward/backward of one loss pass over `rollouts` (the pass's completions).

        3PO uses it to hold the policy at a posterior sample while the gradient is taken. `loss_pass` is the
        value of `rollouts.loss_pass` for this pass (0 when there is a single pass)."""
        return nullcontext()

    def on_rl_step_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        """After the optimizer step and the engine sync of this RL step."""


def check_rl_callbacks(callbacks: Iterable[Any], algorithm: AlgorithmConfig,
                       rollout: RolloutConfig = RolloutConfig(), *, ranks: int = 1, lora: bool = False) -> None:
    """Each `RLVRCallback`'s `check_algorithm(algorithm)`, then the module's own rules that need the callbacks
    (a group of one only where a callback sets the sample counts; async rollouts only with callbacks that allow
    them, and on `ranks` ranks, with `lora` adapters: `lit_rlvr.rollout.source.async_refusals`)."""
    rl = [cb for cb in callbacks if isinstance(cb, RLVRCallback)]
    for cb in rl:
        cb.check_algorithm(algorithm)
    baselines = [type(cb).__name__ for cb in rl if cb.sets_baseline]
    if len(baselines) > 1:  # the advantage has one baseline: which would win is not obvious
        raise ConfigError([f"{' and '.join(baselines)} both set each prompt's baseline (V0.5's prior, DBB's history: "
                           "algorithm.advantages=dbb); use one of them"])
    counts_set_by = next((type(cb).__name__ for cb in rl if cb.sets_sample_counts), None)
    refused_by = {type(cb).__name__: cb.async_refusal for cb in rl if cb.async_refusal}
    ConfigError.check(group_size_problem(algorithm.group_size, counts_set_by)
                      + async_refusals(rollout, refused_by=refused_by, rounds_by=counts_set_by, ranks=ranks,
                                       ivon_lora=algorithm.optimizer == "ivon" and lora))
