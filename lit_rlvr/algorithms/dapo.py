"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025, arXiv 2503.14476)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from lit_rlvr import functional as F
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts


class DAPOModule(GRPOModule):
    """GRPO plus DAPO's four techniques; each is an argument, so the paper's ablation can be rerun:

    * clip-higher (§3.1, Eq. 10): `eps_high` = 0.28 with `eps_low` = 0.2 — the base PPO-clip loss;
    * dynamic sampling (§3.2, Eq. 11): groups whose rewards are all equal (all right or all wrong) have zero
      advantage and are dropped; the batch is refilled with the groups of the *next* data batches until it
      holds `data.batch_size` groups or `max_refill_batches` extra batches were drawn (the cap; the step then
      trains on the groups it has, and logs `dapo/cap_hit` = 1). How: `training_step` takes Lightning's
      `dataloader_iter`, so refills are the data stream's next batches (the same prompts a plain run would
      see next; nothing is read twice). Like verl's recipe, each refill generates a whole batch; surplus
      groups of the last batch are discarded. Dropping uses the task reward (before length shaping), i.e.
      correctness, as Eq. 11;
    * token-level loss (§3.3, Eq. 12): `loss_aggregation` = `token-mean`;
    * overlong reward shaping (§3.4, Eq. 13): the soft penalty of `functional.overlong_penalty` over the last
      `overlong_cache_len` tokens before `max_new_tokens`, scaled by `overlong_penalty_factor` (verl's
      `overlong_buffer.penalty_factor`; 1 = the paper's), is added to the reward before the advantages
      (`overlong_cache_len` 0 switches it off).

    Metrics: `dapo/kept_groups` (groups trained on), `dapo/refill_rounds` (extra batches drawn),
    `dapo/cap_hit`, `reward/accuracy_generated` and `reward/mean_generated` (over *all* generated rollouts:
    `reward/accuracy` and `reward/mean` are measured on the kept groups, which all-right/all-wrong groups have
    left), `reward/overlong_frac`;
    `rollouts/per_step` counts every generated rollout, dropped ones included.
    """

    def __init__(self, eps_high: float = 0.28, loss_aggregation: str = "token-mean", dynamic_sampling: bool = True,
                 max_refill_batches: int = 3, overlong_cache_len: int = 4, overlong_penalty_factor: float = 1.0,
                 **kwargs):
        # the options' ranges are rows of lit_rlvr.config.options, checked with the base module's before the model loads
        super().__init__(eps_high=eps_high, loss_aggregation=loss_aggregation, **kwargs)
        self._data_iter: Optional[Iterator] = None
        self._refill = 0  # refill batches drawn this step; they sample from their own seeds (`seed_stream`)

    def training_step(self, dataloader_iter: Iterator) -> Any:
        """Lightning passes the data iterator (it sees the `dataloader_iter` argument) so that dynamic
        sampling can draw further batches within this step."""
        batch, batch_idx, _ = next(dataloader_iter)
        self._note_batch()
        self._data_iter = dataloader_iter
        try:
            return super().training_step(batch, batch_idx)
        finally:
            self._data_iter = None
            self._refill = 0

    def collect_rollouts(self, batch: dict[str, list]) -> Rollouts:
        """Rollouts of `len(batch)` non-constant groups, drawn from this batch and up to `max_refill_batches`
        next ones (Eq. 11)."""
        if not self.hparams.dynamic_sampling:
            return super().collect_rollouts(batch)
        target = len(batch["prompt"])
        kept: list[Rollouts] = []
        correct, total, generated = 0.0, 0.0, 0
        while True:
            rollouts = super().collect_rollouts(batch)
            keep = ~F.constant_groups(rollouts.rewards, rollouts.group, rollouts.num_groups)  # [B]
            kept.append(rollouts.select_groups(keep))
            correct += float((rollouts.rewards > 0).sum())
            total += float(rollouts.rewards.sum())
            generated += rollouts.num_samples
            have = sum(part.num_groups for part in kept)
            if have >= target or self._refill >= self.hparams.max_refill_batches:
                break
            batch = self._next_batch()
            if batch is None:  # the epoch's data ran out: train on what we have
                break
            self._refill += 1
        if have == 0:  # every group constant even after the refills: all advantages are 0 this step
            out = rollouts
        else:
            out = Rollouts.stack_groups(kept, self.tokenizer.pad_token_id)
            out = out.select_groups(torch.arange(out.num_groups) < target)
        self.log_metrics({"dapo/kept_groups": float(min(have, target)), "dapo/refill_rounds": float(self._refill),
                          "dapo/cap_hit": float(have < target), "reward/accuracy_generated": correct / max(generated,
                                                                                                           1),
                          "reward/mean_generated": total / max(generated, 1)})
        return out

    def _next_batch(self) -> Optional[dict[str, list]]:
        if self._data_iter is None:  # called outside `fit` (e.g. a direct training_step call): no refill
            return None
        try:
            batch, _, _ = next(self._data_iter)
        except StopIteration:
            return None
        self._note_batch()
        return batch

    def _note_batch(self) -> None:
        """Tell the datamodule a batch was used: it keeps the data position that a resume continues from
        (Lightning skips its batch hooks when the step reads the iterator itself)."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if hasattr(datamodule, "note_batches"):
            datamodule.note_batches(1)

    def seed_stream(self) -> tuple[int, ...]:
        """Refill batches draw from their own random stream (rounds restart at 0 for each batch)."""
        return (-self._refill,) if self._refill else ()

    def compute_advantages(self, rollouts: Rollouts) -> tuple[Tensor, dict[str, Tensor]]:
        """GRPO advantages of the reward plus the overlong penalty (Eq. 13); `rollouts.rewards` stays the task
        reward (so `reward/accuracy` keeps its meaning). With an environment the budget is the rollout's,
        `env.max_tokens`, over its whole response (turns and observations), not one turn's `max_new_tokens`."""
        hp = self.hparams
        if hp.overlong_cache_len == 0:
            return super().compute_advantages(rollouts)
        if self.environment is None:
            lengths, max_len = rollouts.response_mask.sum(-1), hp.max_new_tokens  # [N]
        else:
            lengths, max_len = rollouts.response_attention_mask.sum(-1), self.environment.max_tokens  # [N]
        penalty, metrics = F.overlong_penalty(lengths, max_len=max_len, cache_len=hp.overlong_cache_len,
                                              factor=hp.overlong_penalty_factor)
        shaped = replace(rollouts, rewards=rollouts.rewards + penalty)  # [N]; a view of the batch, nothing copied
        adv, adv_metrics = super().compute_advantages(shaped)
        return adv, {**metrics, "reward/shaped_mean": shaped.rewards.mean(), **adv_metrics}
