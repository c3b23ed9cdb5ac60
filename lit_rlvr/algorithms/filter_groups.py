"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2, Eq. 11) as a collector any loss can use.

`algorithm.filter_groups` carries verl's keys and meanings: `enable`, `metric` (what must differ within a group:
`acc` correctness, `score` the task reward), `max_num_gen_batches` (generation batches per step, the first
included; 0 = no limit). Groups whose metric is equal for every completion have zero advantage and are dropped;
the batch is refilled with the groups of the data stream's *next* batches (the prompts a plain run would see
next; nothing is read twice) until it holds `data.batch_size` groups. As in verl's recipe each refill generates a
whole batch and the surplus groups of the last one are discarded; running out of the budget stops the run with
one line naming the key (verl raises there too); running out of data trains on the groups it has.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from lit_rlvr import functional as F
from lit_rlvr.config.errors import GenerationBudgetError
from lit_rlvr.config.settings import FILTER_GROUPS_KEY as KEY
from lit_rlvr.config.settings import FilterGroups
from lit_rlvr.rollout.batch import Rollouts

log = logging.getLogger(__name__)
Batch = dict[str, list]


class GroupFilter:
    """Collects one step's rollouts: this batch's groups whose metric differs, refilled from the next batches.

    `collect(batch, rollout, next_batch)` with `rollout(batch, seed_stream) -> Rollouts` (the module's plan →
    callbacks → generate; each refill samples from its own seed stream) and `next_batch() -> batch or None` (the
    data stream's next batch; None when it ran out). Returns the rollouts and the metrics `dapo/kept_groups`,
    `dapo/refill_rounds`, `dapo/cap_hit` (1 when the data ran out before the batch was full; past the budget
    the run stops instead), and `reward/accuracy_generated`,
    `reward/mean_generated` over *all* generated rollouts (`reward/accuracy` and `reward/mean` are measured on the
    kept groups).
    """

    def __init__(self, options: FilterGroups, pad_token_id: int):
        self.options = options
        self.pad_token_id = pad_token_id

    def collect(self, batch: Batch, rollout: Callable[[Batch, tuple[int, ...]], Rollouts],
                next_batch: Callable[[], Optional[Batch]]) -> tuple[Rollouts, dict[str, Tensor]]:
        target = len(batch["prompt"])
        budget = self.options.max_num_gen_batches
        kept: list[Rollouts] = []
        correct, total, generated, refills = 0.0, 0.0, 0, 0
        while True:
            rollouts = rollout(batch, (-refills,) if refills else ())
            keep = F.informative_groups(rollouts.rewards, rollouts.group, rollouts.num_groups,
                                        metric=self.options.metric)  # [B]
            kept.append(rollouts.select_groups(keep))
            correct += float((rollouts.rewards > 0).sum())
            total += float(rollouts.rewards.sum())
            generated += rollouts.num_samples
            have = sum(part.num_groups for part in kept)
            if have >= target:
                break
            if budget and refills + 1 >= budget:
                raise GenerationBudgetError([
                    f"{KEY}.max_num_gen_batches={budget}: {refills + 1} generation batches gave {have} of {target} "
                    f"groups whose {self.options.metric} differs; raise it (0 = no limit), or set {KEY}.enable=false"])
            batch = next_batch()
            if batch is None:  # the epoch's data ran out: train on what we have
                break
            refills += 1
            if refills in (10, 100, 1000, 10000):  # a step that keeps refilling (no cap) says so as it goes
                log.warning("%s: %d generation batches in this step gave %d of %d groups whose %s differs (no "
                            "update until the batch is full; %s.max_num_gen_batches caps it)", KEY, refills, have,
                            target, self.options.metric, KEY)
        if have == 0:  # every group constant and the data ran out: all advantages are 0 this step
            out = rollouts
        else:
            out = Rollouts.stack_groups(kept, self.pad_token_id)
            out = out.select_groups(torch.arange(out.num_groups) < target)
        metrics = {"dapo/kept_groups": float(min(have, target)), "dapo/refill_rounds": float(refills),
                   "dapo/cap_hit": float(have < target), "reward/accuracy_generated": correct / max(generated, 1),
                   "reward/mean_generated": total / max(generated, 1)}
        return out, {k: torch.tensor(v) for k, v in metrics.items()}


class DataStream:
    """The data stream of one step whose collector reads further batches (the group filter's refills).

    Lightning hands a step the data iterator only when `training_step` takes `dataloader_iter`, and then skips its
    batch hooks: this owns the iterator for the step and tells the datamodule (`note_batches`) of every batch it
    hands out, so the datamodule keeps the data position that a resume continues from."""

    def __init__(self, iterator: Optional[Iterator], datamodule: Any = None):
        self.iterator, self.datamodule = iterator, datamodule

    def first(self) -> tuple[Batch, int]:
        """The step's own batch and its index."""
        batch, batch_idx, _ = next(self.iterator)
        self._note_batch()
        return batch, batch_idx

    def next_batch(self) -> Optional[Batch]:
        """The stream's next batch within this step, or None when it ran out (or outside a fit: no iterator)."""
        if self.iterator is None:
            return None
        try:
            batch, _, _ = next(self.iterator)
        except StopIteration:
            return None
        self._note_batch()
        return batch

    def _note_batch(self) -> None:
        if hasattr(self.datamodule, "note_batches"):
            self.datamodule.note_batches(1)
