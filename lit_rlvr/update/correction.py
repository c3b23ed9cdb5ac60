"""`RolloutCorrector`: what one update runs of verl's rollout correction (`algorithm.rollout_correction`).

The settings and their checks are `lit_rlvr.config.rollout_correction.RolloutCorrection` (which computes nothing);
the math is `lit_rlvr.functional.rollout_correction`, composed here into the loss's token weights. The corrector
keeps the one thing that lives across an update's loss passes (bypass mode: the first pass's forwards, for the
`mismatch/*` metrics) and calls nothing back: the update hands it the recomputed π_old and each micro-batch's
log-probs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from lit_rlvr.config.rollout_correction import RolloutCorrection
from lit_rlvr.functional import rollout_correction as RC
from lit_rlvr.rollout.batch import Rollouts


class RolloutCorrector:
    """What one update (`lit_rlvr.update.Update`) runs of the correction: before it (`before_update`), in each
    micro-batch loss (`in_loss`) and after the first mini-batch's loss passes (`first_pass_metrics`)."""

    def __init__(self, options: RolloutCorrection):
        self.options = options
        self._rows: Optional[list[tuple[Tensor, Tensor, Tensor]]] = None  # bypass: the first pass's forwards

    @property
    def needs_old_logp(self) -> bool:
        """Decoupled mode: the update recomputes π_old (one extra no-grad forward) before `before_update`."""
        return not self.options.bypass

    def before_update(self, rollouts: Rollouts,
                      old_logp: Optional[Tensor] = None) -> tuple[Rollouts, dict[str, Tensor]]:
        """The batch the loss passes take, and the correction's metrics. Bypass mode: the engine's log-probs stay
        π_old; the loss forwards before the first optimizer step (at the weights that sampled) give the
        `mismatch/*` metrics, at no cost. Decoupled mode: `old_logp` [N, T], the trainer's π_old (recomputed by the
        update when `needs_old_logp`), becomes the loss's old log-probs; the metrics, IS weights and rejection
        mask come from π_old/π_engine."""
        if self.options.bypass:
            self._rows = []
            return rollouts, {}
        self._rows = None
        if old_logp is None:
            raise ValueError("decoupled rollout correction: before_update needs the recomputed old_logp")
        weights, metrics = self.decoupled_weights(old_logp, rollouts.old_logp, rollouts.response_mask)
        return replace(rollouts, old_logp=old_logp, token_weights=weights), metrics

    def decoupled_weights(self, old_logp: Tensor, engine_logp: Tensor,
                          mask: Tensor) -> tuple[Optional[Tensor], dict[str, Tensor]]:
        """Decoupled mode: the loss's token weights [N, T] (IS weights × rejection mask; None when both are off)
        and the mismatch metrics, all from π_old/π_engine. old_logp, engine_logp, mask: [N, T]."""
        options = self.options
        _, metrics = RC.mismatch_metrics(old_logp, engine_logp, mask)
        log_ratio = old_logp - engine_logp.to(old_logp.dtype)  # [N, T]
        weights = None
        if options.rollout_is is not None:
            weights, is_metrics = RC.truncated_is_weights(log_ratio, mask, level=options.rollout_is,
                                                          threshold=options.rollout_is_threshold)
            metrics.update(is_metrics)
        if options.rollout_rs is not None:
            keep, rs_metrics = RC.rejection_mask(log_ratio, mask, modes=options.rollout_rs,
                                                 threshold=options.rs_threshold)
            metrics.update(rs_metrics)
            keep = keep.to(old_logp.dtype)
            weights = keep if weights is None else weights * keep
        return weights, metrics

    def in_loss(self, rollouts: Rollouts, logp: Tensor, engine_logp: Tensor, mask: Tensor, *,
                record: bool = True) -> Rollouts:
        """The micro-batch with its token weights on `logp`'s device; in bypass mode times the rejection mask
        from the current log-probs (as verl's bypass loss takes it: rejected terms become 0 and stay in the
        normalisers). logp, engine_logp, mask: [n, T]. `record`: False for a stand-in micro-batch (FSDP's
        zero-weight ones), which the first pass's metrics must not count."""
        weights = None if rollouts.token_weights is None else rollouts.token_weights.to(logp.device)  # [n, T]
        if self.options.bypass and self.options.rollout_rs is not None:
            keep, _ = RC.rejection_mask(logp.detach() - engine_logp.to(logp.dtype), mask,
                                        modes=self.options.rollout_rs, threshold=self.options.rs_threshold)
            weights = keep.to(logp.dtype) if weights is None else weights * keep
        if self._rows is not None and record:
            self._rows.append((logp.detach(), engine_logp, mask))
        if weights is rollouts.token_weights:  # nothing to add: the caller's batch as it is
            return rollouts
        return replace(rollouts, token_weights=weights)

    def first_pass_metrics(self) -> dict[str, Tensor]:
        """Bypass mode, once per update: the mismatch metrics (and rejected fraction) of the recorded forwards
        ([n_i, T_i] rows; widths may differ); {} afterwards and in decoupled mode."""
        rows, self._rows = self._rows, None
        if not rows:
            return {}
        width = max(r[0].shape[1] for r in rows)
        logp, engine, mask = (torch.cat([_pad(r[i], width) for r in rows]) for i in range(3))  # [N, T]
        _, metrics = RC.mismatch_metrics(logp, engine, mask)
        if self.options.rollout_rs is not None:
            _, rs_metrics = RC.rejection_mask(logp - engine.to(logp.dtype), mask, modes=self.options.rollout_rs,
                                              threshold=self.options.rs_threshold)
            metrics.update(rs_metrics)
        return metrics


def _pad(t: Tensor, width: int) -> Tensor:
    """Right-pad [n, T'] to [n, width] with zeros (False for a mask)."""
    return torch.nn.functional.pad(t.detach().cpu(), (0, width - t.shape[1]))
