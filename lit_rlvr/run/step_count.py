"""The RL step count of a fit: Lightning's count of the batches that stepped, the `step` of every logged row.

A training step that trains nothing (async rollouts while the producer's first batches are generated: the source
has no batch yet) must not count, or metrics.csv's steps, `val_check_interval` and `max_steps` would count batches
that never updated the policy. Lightning has no public way to say so: returning None from a manual-optimization
`training_step` still counts the batch, so `not_a_step` takes it back from the private counter that Lightning
(2.x, `_TrainingEpochLoop._batches_that_stepped`) adds it to after the step; `rl_step` reads that counter.

A resume restores Lightning's count of the batches done in the epoch it restarts, in the checkpoint's batch size;
`rescale_epoch_batches` puts it in this run's (a resume with another `data.batch_size`), or Lightning ends the epoch
after the old count: a checkpoint at an epoch's end with 8 prompts a batch, resumed with 4, ran the next epoch for
2 batches of 4 and skipped its other half.
"""

from __future__ import annotations

from typing import Any


def rl_step(trainer: Any) -> int:
    """The RL steps of this fit so far (as metrics.csv counts them)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def not_a_step(trainer: Any) -> None:
    """The current training step trained nothing: Lightning adds it to the count after the step; take it back."""
    trainer.fit_loop.epoch_loop._batches_that_stepped -= 1


def rescale_epoch_batches(trainer: Any, saved_batch_size: int, batch_size: int) -> None:
    """The batches done in the epoch a resumed fit restarts, counted by Lightning in the checkpoint's batch size
    (`saved_batch_size` prompts a batch), in this run's instead: the same prompts, so Lightning ends the epoch where
    the data does (and moves on at once when it is done); the counts keep their offsets from one another (a
    checkpoint written at a batch's end has one batch not yet counted completed)."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = current.ready * saved_batch_size // batch_size - current.ready
    for field in ("ready", "started", "processed", "completed"):
        setattr(current, field, max(0, getattr(current, field) + shift))
