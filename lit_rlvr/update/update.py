"""`Update`: the training half of one RL step (docs/architecture.md §3), from a batch with advantages to optimizer
steps, the twin of the rollout driver.

It runs `ppo_epochs` × `mini_batches` optimizer steps; each step runs the loss passes (one per weight sample for
M3PO) inside the callbacks' loss contexts, micro-batch by micro-batch (`plan_micro_batches`, which π_old's recompute
shares), then clips, checks finiteness and steps. It is built from explicit parts (the policy, the optimizer and
its schedule, the typed loss and update settings, the rollout correction, the loss function, the KL reference, the
loss contexts, the backward function) and called with what changes per step (the batch, the step); it returns its
metrics and never reads a module or a trainer, so a plain script runs it without Lightning.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Callable, MutableMapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from lit_rlvr import functional as F
from lit_rlvr.config.errors import MaskedStepError, NonFiniteError
from lit_rlvr.config.rollout_correction import RolloutCorrection
from lit_rlvr.config.settings import LossConfig, UpdateConfig
from lit_rlvr.models.lora import reference_model
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.run import distributed as D
from lit_rlvr.run.step_timer import StepTimer
from lit_rlvr.update.correction import RolloutCorrector
from lit_rlvr.update.forward import forward_logprobs
from lit_rlvr.update.micro_batches import plan_micro_batches

log = logging.getLogger(__name__)

# loss metrics that are means over response tokens, and over sequences (a loss may move one: `F.SEQUENCE_METRICS`)
TOKEN_METRICS = frozenset({"loss/entropy", "loss/pg_clipfrac", "loss/pg_clipfrac_lower", "loss/approx_kl"})
SEQUENCE_METRICS = frozenset({"loss/seq_mask_frac"})

PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, Rollouts], tuple[Tensor, dict[str, Tensor]]]


def _autograd_backward(loss: Tensor) -> None:
    loss.backward()


class Update:
    """The optimizer steps of one batch: see the module docstring.

    Args:
        policy: the trained model; its gradients are clipped and stepped, its weights are the KL base with LoRA.
        optimizer: steps the policy's parameters (`zero_grad`, `step`; IVON's `discard_samples` on a skipped step).
            None: loss passes only (`backward_pass`); `run` needs one.
        scheduler: stepped after each optimizer step (None: none).
        loss: the surrogate, KL and entropy settings. update: epochs, mini-batches, micro-batches, `max_bad_steps`.
        grad_clip: the gradient norm's bound (0 or None: off).
        temperature: the sampling temperature, at which the loss scores the sampled tokens.
        norm_len: the token-sum aggregation's constant (`max_new_tokens`).
        policy_loss: `(logp, old_logp, advantages, mask, rollouts) -> (loss, metrics)` of one micro-batch, with the
            rollouts' token weights (`GRPOModule.policy_loss`: a subclass point).
        correction: the rollout correction (its default, off, when None).
        ref_policy: the frozen KL reference copy (None: LoRA's base, the policy with its adapter off).
        loss_contexts: `(rollouts, loss_pass) -> context` each, entered in order around one loss pass (the
            callbacks' `loss_context`: 3PO holds a weight sample).
        backward: `loss -> None` (Lightning's `manual_backward` in a fit; None: plain autograd).
        model: what the loss's forward runs (the compiled policy with `model.compile`; the policy by default).
        counters: where non-finite steps are counted (`skipped_steps`, `bad_steps_in_row`): the run's counters,
            saved in its checkpoints (a fresh dict by default).
        timer: the step's phase timer (`old_logp_s`: decoupled mode's extra forward).
        device: where the forwards run (None: where the policy's first parameter is).
        token_metrics, sequence_metrics: the loss metrics that average over tokens, and over sequences (those of
            `loss.policy_loss`'s `functional.SEQUENCE_METRICS` move to the latter).
        hint: what the run keeps and what to do, asked when too many non-finite steps stop it (as the collector's).
    """

    def __init__(self, policy: nn.Module, optimizer: Optional[Any], scheduler: Optional[Any] = None, *,
                 loss: LossConfig, update: UpdateConfig, grad_clip: Optional[float], temperature: float,
                 norm_len: int, policy_loss: PolicyLoss, correction: Optional[RolloutCorrector] = None,
                 ref_policy: Optional[nn.Module] = None,
                 loss_contexts: Sequence[Callable[[Rollouts, int], AbstractContextManager]] = (),
                 backward: Optional[Callable[[Tensor], None]] = None, model: Optional[nn.Module] = None,
                 counters: Optional[MutableMapping[str, int]] = None, timer: Optional[StepTimer] = None,
                 device: Optional[Union[str, torch.device]] = None,
                 token_metrics: frozenset = TOKEN_METRICS, sequence_metrics: frozenset = SEQUENCE_METRICS,
                 hint: Optional[Callable[[], str]] = None):
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.loss, self.settings = loss, update
        self.grad_clip = grad_clip if grad_clip and grad_clip > 0 else float("inf")
        self.temperature, self.norm_len, self.policy_loss = temperature, norm_len, policy_loss
        self.correction = correction if correction is not None else RolloutCorrector(RolloutCorrection())
        self.ref_policy, self.loss_contexts = ref_policy, loss_contexts
        self.backward = backward if backward is not None else _autograd_backward
        self.model = model if model is not None else policy
        self.hint = hint
        self.counters = counters if counters is not None else {"skipped_steps": 0, "bad_steps_in_row": 0}
        self.timer = timer if timer is not None else StepTimer()
        self.device = device if device is not None else next(policy.parameters()).device
        per_sequence = F.SEQUENCE_METRICS[loss.policy_loss]  # a sequence-level loss's (GSPO's clip fraction)
        self.token_metrics, self.sequence_metrics = token_metrics - per_sequence, sequence_metrics | per_sequence
        self._mask_counts: Optional[Tensor] = None  # during `run`: [counted, kept] loss tokens

    # -- one update --------------------------------------------------------------------------------------------
    def run(self, rollouts: Rollouts, *, step: int = 0) -> dict[str, Tensor]:
        """`ppo_epochs` × `mini_batches` optimizer steps on `rollouts` (advantages set); returns the update's metrics
        (`loss/*` and `micro/*` averaged over loss passes, `grad/norm`, the correction's `mismatch/*`). `step`: the
        run's optimizer step, for messages."""
        if self.optimizer is None:
            raise ValueError("Update.run needs an optimizer (built with optimizer=None: loss passes only)")
        settings = self.settings
        # every rank takes the same number of optimizer steps (FSDP's collectives), each on at least one rollout:
        # a batch smaller than mini_batches on some rank (DAPO kept few groups) gets one step per rollout
        fewest = -D.global_max(-rollouts.num_samples)
        if fewest < settings.mini_batches:
            log.warning("step %d: a rank holds %d rollouts, fewer than algorithm.mini_batches=%d: %d optimizer steps",
                        step, fewest, settings.mini_batches, fewest)
        steps = min(settings.mini_batches, fewest)
        rollouts, metrics = self.correct(rollouts)
        self._mask_counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss tokens: counted, kept
        order = torch.arange(rollouts.num_samples)
        loss_sums: dict[str, Tensor] = {}  # per-pass metrics, summed over passes
        grad_norms: list[Tensor] = []
        passes = 0
        for _epoch in range(settings.ppo_epochs):
            for mini in order.tensor_split(steps):  # exactly that many (torch.chunk can give fewer)
                self.optimizer.zero_grad()
                earlier_finite = True
                for n, (loss_pass, index) in enumerate(loss_passes(rollouts, mini)):
                    if n:  # M3PO: the next pass's context clears .grad, so the previous pass's is checked first
                        earlier_finite &= bool(torch.isfinite(self.grad_norm()))
                    self.backward_pass(rollouts.select(index), loss_pass, loss_sums)
                    passes += 1
                metrics.update(self.correction.first_pass_metrics())  # mismatch/*, once per update
                grad_norms.append(self._optimizer_step(loss_sums, earlier_finite, step))
        metrics.update({k: v / passes for k, v in loss_sums.items()})
        metrics["grad/norm"] = torch.stack(grad_norms).mean()
        self._check_not_all_masked(step)
        return metrics

    def correct(self, rollouts: Rollouts) -> tuple[Rollouts, dict[str, Tensor]]:
        """The batch the loss passes take, and the correction's metrics (`RolloutCorrector.before_update`); in
        decoupled mode after π_old's recompute (`time/old_logp_s`): IS weights, rejection."""
        old = None
        if self.correction.needs_old_logp:
            with self.timer("old_logp_s"):
                old = self.old_logprobs(rollouts)  # [N, T]
        return self.correction.before_update(rollouts, old)

    @torch.no_grad()
    def old_logprobs(self, rollouts: Rollouts) -> Tensor:
        """The trainer's log-probs [N, T] of the sampled tokens at the current weights (verl's recomputed π_old; 0
        on padding), micro-batched as the loss passes are."""
        plan = plan_micro_batches(rollouts, micro_batch_size=self.settings.micro_batch_size,
                                  micro_batch_tokens=self.settings.micro_batch_tokens)
        old = torch.zeros_like(rollouts.old_logp)  # [N, T]
        for micro, part, real in plan.parts(rollouts):
            logp, _ = self.forward_logprobs(self.policy, part)  # [m, T'] (T' <= T: trimmed)
            if real:
                width = logp.shape[1]
                old[micro, :width] = logp.float().cpu() * part.response_mask[:, :width]
        return old

    def backward_pass(self, rollouts: Rollouts, loss_pass: int, sums: dict[str, Tensor]) -> None:
        """Backward of one loss pass, micro-batch by micro-batch. Each micro-batch's loss is weighted by its share
        of the global pass (tokens for token-mean, else sequences) times the world size, since data-parallel
        gradients are averaged over ranks: the sum equals the loss of the whole global batch. Metrics are
        weighted the same way by what they average over (`token_metrics`, `sequence_metrics`, else the loss's
        unit), so they do not depend on the micro-batching or the number of ranks."""
        tokens = rollouts.response_mask.sum(-1).double()  # [n]
        seqs = F.sequence_rows(rollouts.response_mask).double()  # [n] the rows sequence means count (not empty ones)
        world = D.world_size()
        totals = torch.tensor([float(tokens.sum()), float(seqs.sum())], dtype=torch.float64)
        total_tokens, total_seqs = D.all_reduce(totals).clamp_min(1).tolist()
        plan = plan_micro_batches(rollouts, micro_batch_size=self.settings.micro_batch_size,
                                  micro_batch_tokens=self.settings.micro_batch_tokens)
        for k, v in plan.metrics.items():  # averaged over passes with the other pass metrics
            sums[k] = sums.get(k, 0.0) + v
        with ExitStack() as stack:
            for context in self.loss_contexts:
                stack.enter_context(context(rollouts, loss_pass))
            for micro, part, real in plan.parts(rollouts):
                token_w = float(tokens[micro].sum()) / total_tokens * world if real else 0.0
                seq_w = float(seqs[micro].sum()) / total_seqs * world if real else 0.0
                share = token_w if self.loss.loss_aggregation == "token-mean" else seq_w
                loss, metrics = self.micro_batch_loss(part, share)
                self.backward(loss)
                for k, v in (metrics.items() if real else ()):
                    w = token_w if k in self.token_metrics else seq_w if k in self.sequence_metrics else share
                    sums[k] = sums.get(k, 0.0) + v * w

    def forward_logprobs(self, model: nn.Module, rollouts: Rollouts) -> tuple[Tensor, Tensor]:
        """`forward_logprobs` at the sampling temperature on the update's device: log-probs [n, T], logits [n, T, V]."""
        return forward_logprobs(model, rollouts, temperature=self.temperature, device=self.device)

    def micro_batch_loss(self, rollouts: Rollouts, weight: float) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch, scaled by its share `weight` of the pass so micro-batches sum exactly."""
        settings = self.loss
        logp, logits = self.forward_logprobs(self.model, rollouts)  # [n, T], [n, T, V]
        mask = rollouts.response_mask.to(self.device)
        old = rollouts.old_logp.to(self.device)
        advantages = rollouts.advantages.to(self.device)  # [n]
        keep_metrics, keep = {}, None
        if settings.seq_mask_tau is not None:
            # 3PO: a sequence whose ratio left [1/τ, τ] gets no policy gradient. Its terms become 0 but its tokens
            # stay in every normalisation, as the micro-batch weights assume: the loss cannot depend on micro-batching
            keep, keep_metrics = F.sequence_importance_mask(logp, old, mask, tau=settings.seq_mask_tau)  # [n]
            advantages = advantages * keep  # [n]
        rollouts = self.correction.in_loss(rollouts, logp, old, mask, record=weight > 0)  # verl's IS, RS
        if self._mask_counts is not None and weight > 0:
            self._count_kept(mask, keep, rollouts.token_weights)
        loss, metrics = self.policy_loss(logp, old, advantages, mask, rollouts)
        metrics.update(keep_metrics)
        with torch.set_grad_enabled(settings.entropy_coef > 0):
            entropy = F.entropy_from_logits(logits / self.temperature)  # [n, T]
        entropy_mean = F.aggregate(entropy, mask, settings.loss_aggregation, norm_len=self.norm_len)
        loss = loss - settings.entropy_coef * entropy_mean
        # the metric is nats per token whatever the loss aggregation, so runs of different losses compare
        metrics["loss/entropy"] = F.aggregate(entropy.detach(), mask, "token-mean")
        if settings.kl_coef > 0:
            ref, adapter_off = reference_model(self.policy, self.ref_policy)  # LoRA: the base, adapter off
            with torch.no_grad(), adapter_off:
                ref_logp, _ = self.forward_logprobs(ref, rollouts)  # [n, T]
            per_token = F.kl_penalty(logp, ref_logp, estimator=settings.kl_estimator,
                                     k3_cap=settings.kl_k3_cap)  # [n, T]
            kl = F.aggregate(per_token, mask, settings.loss_aggregation, norm_len=self.norm_len)
            loss = loss + settings.kl_coef * kl
            metrics["loss/kl_ref"] = kl.detach()
        metrics["loss/policy"] = loss.detach()
        return loss * weight, metrics

    # -- masked and non-finite steps ---------------------------------------------------------------------------
    def _count_kept(self, mask: Tensor, keep: Optional[Tensor], token_weights: Optional[Tensor]) -> None:
        """Adds the micro-batch's counted tokens and those whose loss term is not masked to 0 (by the sequence
        mask [n] or a token weight [n, T]) to this update's counts, kept on the device (no sync per micro-batch)."""
        kept = mask.bool()  # [n, T]
        if keep is not None:
            kept = kept & keep.bool().to(kept.device)[:, None]  # [n, T]
        if token_weights is not None:
            kept = kept & (token_weights.to(kept.device) != 0)  # [n, T]
        self._mask_counts += torch.stack([mask.sum(), kept.sum()]).to(self._mask_counts)

    def _check_not_all_masked(self, step: int) -> None:
        """Stops the run the first time an update's loss had tokens and masked every one of them: each later step
        would be the same (loss 0, gradient 0), silently. Names the settings that mask."""
        counted, kept = D.all_reduce(self._mask_counts.cpu()).tolist()
        self._mask_counts = None
        if counted == 0 or kept > 0:
            return
        tau = self.loss.seq_mask_tau
        keys = [f"algorithm.seq_mask_tau={tau!r}"] if tau else []
        keys += self.correction.options.masking_settings()
        settings = ", ".join(keys) if keys else "no masking setting is on (a callback's or subclass's token weights)"
        raise MaskedStepError([f"step {step}: every one of the {int(counted)} loss tokens was masked "
                               f"(loss 0, gradient 0), by {settings}; widen the bounds (the mismatch/* metrics "
                               "show the ratios) or turn them off (null)"])

    def grad_norm(self) -> Tensor:
        """The policy's gradient norm, over all shards under FSDP2."""
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        return D.whole(norm)  # FSDP2: a DTensor

    def _optimizer_step(self, sums: dict[str, Tensor], earlier_finite: bool, step: int) -> Tensor:
        """Clip, check finiteness (also of the loss passes before the last: `earlier_finite`), step; returns the
        gradient norm before clipping."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip) if params else torch.tensor(0.0)
        norm = D.whole(norm)  # FSDP2: the norm over all shards, as a DTensor
        loss_ok = bool(torch.isfinite(sums.get("loss/policy", torch.tensor(0.0))))
        if not (loss_ok and earlier_finite and bool(torch.isfinite(norm))):
            self._skip_step("loss" if not loss_ok else "gradient", step)
            return norm.detach()
        self.counters["bad_steps_in_row"] = 0
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return norm.detach()

    def _skip_step(self, what: str, step: int) -> None:
        self.counters["skipped_steps"] += 1
        self.counters["bad_steps_in_row"] += 1
        self.optimizer.zero_grad()
        discard = getattr(self.optimizer, "discard_samples", None)  # IVON: this step's gradient samples must not leak
        if discard is not None:
            discard()
        log.warning("non-finite %s at step %d: step skipped (%d in a row)", what, step,
                    self.counters["bad_steps_in_row"])
        if self.counters["bad_steps_in_row"] >= self.settings.max_bad_steps:
            raise NonFiniteError(f"{self.counters['bad_steps_in_row']} non-finite steps in a row (algorithm."
                                 f"max_bad_steps={self.settings.max_bad_steps}); lower algorithm.lr or check the "
                                 "reward" + (f"; {self.hint()}" if self.hint is not None else ""))


def loss_passes(rollouts: Rollouts, mini: Tensor) -> list[tuple[int, Tensor]]:
    """(loss pass, row index) of each loss pass over the mini-batch `mini`: one pass unless a callback set
    `rollouts.loss_pass` (M3PO: one per weight sample)."""
    if rollouts.loss_pass is None:
        return [(0, mini)]
    passes = rollouts.loss_pass[mini]
    return [(int(p), mini[passes == p]) for p in torch.unique(passes)]
