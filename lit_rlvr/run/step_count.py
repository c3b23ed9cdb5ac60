"""The RL step count of a fit: Lightning's count of the batches that stepped, the `step` of every logged row.

A training step that trains nothing (async rollouts while the producer's first batches are generated: the source
has no batch yet) must not count, or metrics.csv's steps, `val_check_interval` and `max_steps` would count batches
that never updated the policy. Lightning has no public way to say so: returning None from a manual-optimization
`training_step` still counts the batch, so `not_a_step` takes it back from the private counter that Lightning
(2.x, `_TrainingEpochLoop._batches_that_stepped`) adds it to after the step; `rl_step` reads that counter.
"""

from __future__ import annotations

from typing import Any


def rl_step(trainer: Any) -> int:
    """The RL steps of this fit so far (as metrics.csv counts them)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def not_a_step(trainer: Any) -> None:
    """The current training step trained nothing: Lightning adds it to the count after the step; take it back."""
    trainer.fit_loop.epoch_loop._batches_that_stepped -= 1
