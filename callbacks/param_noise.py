"""`ParamNoise`: 3PO — exploration in parameter space with IVON weight samples (B3PO, M3PO, C3PO).

Paper: "Parameter Exploration for RLVR via Variational Learning" (Venkatkrishna, Daheim, Gurevych; the method as
this library implements it: docs/architecture.md §5). IVON keeps a Gaussian posterior q(θ) = N(m, σ²),
σ = 1/sqrt(λ(h + δ)), over the weights; a weight sample is θ̂_j = m + σ⊙z_j with z_j seeded by (run seed, IVON step,
j, rank), so the same index j gives the same θ̂_j everywhere within one RL step. Per step, G completions per prompt,
N = num_samples:

              generation (plan.weight_context)      advantages           loss (loss_context)
    b3po      θ̂_0 generates all G                   over the G           at θ̂_0
    m3po      θ̂_j generates G/N, j < N              within each chunk    one pass per j at θ̂_j (IVON averages)
    c3po      θ̂_c generates G/N, c < N              pooled over the G    one pass at a fresh θ̂_N, never pushed

`generate="mean"` is the ablation that separates exploration from the optimizer: the mean m generates every
completion (no weight noise in the rollouts) while the update is C3PO's, at a fresh sample θ̂_N with IVON's step;
only `c3po` takes it.

`IVON.sampled_params` writes θ̂ into the policy in place and restores m bit-exactly on exit; the module pushes
the weights to the engine inside the generation context. With `rollout.mode=async` the producer generates while the
trainer updates, so the generating samples are drawn when the plan is made, into tensors of their own
(`snapshot_posterior`, the same bits), and the producer pushes those (docs/async.md).

Loss contexts use `train=True`: on exit IVON records that sample's gradient (and noise⊙gradient for the Hessian);
the module's single optimizer step per RL step is IVON's update from the recorded samples. The loss uses each
rollout's behaviour log-probs as `old`, so in C3PO the ratio compares θ̂_N with the θ̂_c that generated the
sequence; the module's loss option `seq_mask_tau` τ drops sequences whose ratio exp(Σ_t(logp − old)) leaves [1/τ, τ]
(docs/architecture.md §4). In B3PO and M3PO the loss sample is the generating one, so the ratio is 1 and the mask
keeps everything (in async mode it is the same index drawn at the update's posterior: the ratio measures the lag).
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from typing_extensions import override

from lit_rlvr import functional as F
from lit_rlvr.config.options import convert
from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.config.rollout_correction import RolloutCorrection
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.models.lora import trainable_parameters
from lit_rlvr.optim import IVON, PosteriorSnapshot, bf16_spacing_warning, sample_seed
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from lit_rlvr.run.distributed import whole_stack

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

KEY = "algorithm.callbacks.param_noise"  # config path of this callback, for error messages
VARIANTS = ("b3po", "m3po", "c3po")
GENERATE = ("samples", "mean")


class ParamNoise(RLVRCallback):
    """B3PO / M3PO / C3PO for a `GRPOModule` configured with `optimizer="ivon"` (see the module docstring).

    Args:
        variant: `b3po` (one sample per step), `m3po` (N samples, advantages and gradients per sample) or
            `c3po` (N samples pooled into one group; the paper's best).
        num_samples: N, the weight samples the G completions of a prompt are split over; None = 1 for b3po
            (its only valid value), 4 otherwise (paper). The module's `group_size` must be a multiple of it
            (for m3po at least twice it: advantages are taken within each sample's G/N completions).
        bf16_check_every: steps between checks that σ is above the bf16 spacing of the weights (only with a
            bf16 engine; warns once).
        generate: `samples` (3PO: the weight samples generate) or `mean` (the IVON mean generates; the update is
            unchanged): the ablation "IVON without exploration", c3po only.
    """

    def __init__(self, variant: str = "c3po", num_samples: Optional[int] = None, bf16_check_every: int = 100,
                 generate: str = "samples"):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"{KEY}.variant={variant!r}; valid: {', '.join(VARIANTS)}")
        if generate not in GENERATE or (generate == "mean" and variant != "c3po"):
            raise ValueError(f"{KEY}.generate={generate!r} with variant={variant!r}; valid: 'samples', or 'mean' with "
                             f"variant=c3po (the mean weights generate, C3PO's update)")
        num_samples = (1 if variant == "b3po" else 4) if num_samples is None else convert(f"{KEY}.num_samples",
                                                                                           num_samples, int)
        bf16_check_every = convert(f"{KEY}.bf16_check_every", bf16_check_every, int)
        if num_samples < 1 or (variant == "b3po" and num_samples != 1):
            raise ValueError(f"{KEY}.num_samples={num_samples}: must be >= 1 (b3po uses exactly 1 sample)")
        if bf16_check_every < 1:
            raise ValueError(f"{KEY}.bf16_check_every={bf16_check_every} must be >= 1")
        self.variant, self.num_samples, self.generate = variant, num_samples, generate
        self.bf16_check_every = bf16_check_every
        self._bf16_warned = False
        self._tau_warned = False
        self._memory_checked = False

    def _check_group_size(self, group_size: int) -> None:
        if group_size % self.num_samples:
            raise ValueError(
                f"algorithm.group_size={group_size} is not divisible by {KEY}.num_samples={self.num_samples}: each "
                f"of the N weight samples generates G/N completions per prompt; make algorithm.group_size a "
                f"multiple of {KEY}.num_samples")
        if self.variant == "m3po" and group_size // self.num_samples < 2:
            # M3PO centres each reward within its chunk of G/N: a chunk of one gives A = r − r = 0, no gradient
            raise ValueError(
                f"algorithm.group_size={group_size} with {KEY}.num_samples={self.num_samples} gives M3PO "
                f"{group_size // self.num_samples} completion per weight sample: its advantage within the chunk is "
                f"always 0, so nothing is learned; M3PO needs algorithm.group_size >= 2 x {KEY}.num_samples "
                f"(e.g. algorithm.group_size={2 * self.num_samples}), or use algorithm=c3po, which pools the G")

    # -- checks before any work --------------------------------------------------------------------------------
    @override
    def check_algorithm(self, algorithm: AlgorithmConfig) -> None:
        if algorithm.optimizer != "ivon":
            raise ValueError(f"{KEY} samples weights from IVON's posterior: set algorithm.optimizer=ivon (with "
                             f"algorithm.optimizer_options.ess etc.; see conf/algorithm/c3po.yaml), got "
                             f"algorithm.optimizer={algorithm.optimizer!r}")
        self._check_group_size(algorithm.group_size)
        epochs, minis = algorithm.ppo_epochs, algorithm.mini_batches
        if epochs * minis != 1:
            # a second IVON step inside one RL step would move m and re-seed the samples the rollouts came from
            raise ValueError(f"3PO takes one IVON step per RL step: set algorithm.ppo_epochs=1 and "
                             f"algorithm.mini_batches=1 (got {epochs} and {minis})")
        if not RolloutCorrection.from_options(algorithm.rollout_correction).bypass:
            # π_old recomputed at the mean m: its IS weight π_m/π_engine(θ̂_c) would undo the weight noise
            raise ValueError("3PO samples from IVON weight samples, but algorithm.rollout_correction recomputes π_old "
                             "at the mean weights (bypass_mode=false, which rollout_is or rollout_rs imply when "
                             "bypass_mode is null): set algorithm.rollout_correction.bypass_mode=true (rollout_rs "
                             "works there, rollout_is does not)")
        if algorithm.seq_mask_tau is None and not self._tau_warned:
            log.warning("3PO without the sequence importance mask (algorithm.seq_mask_tau=null); the paper uses 2.0")
            self._tau_warned = True

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._maybe_warn_bf16(pl_module, self._ivon(trainer))

    @staticmethod
    def _ivon(trainer: "pl.Trainer") -> IVON:
        optimizers = trainer.optimizers
        if len(optimizers) != 1 or not isinstance(optimizers[0], IVON):
            raise TypeError(f"{KEY} needs exactly one optimizer, lit_rlvr.optim.IVON; configure_optimizers gave "
                            f"{[type(o).__name__ for o in optimizers]}")
        return optimizers[0]

    # -- the RL step -------------------------------------------------------------------------------------------
    @override
    def on_rollout_plan(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", plan: RolloutPlan) -> None:
        if plan.num_weight_sources != 1 or not plan.uses_mean_weights:
            raise RuntimeError(f"{KEY}: another callback already set the plan's weight sources; 3PO owns them")
        if self.generate == "mean":
            return
        if plan.ahead is not None:  # the producer generates while this thread updates
            nbytes = snapshot_posterior(plan, self._ivon(trainer), self.num_samples, pl_module.policy)
            self._maybe_warn_snapshot_memory(plan, nbytes, pl_module.device)
        else:
            sample_from_posterior(plan, self._ivon(trainer), self.num_samples)

    @override
    def on_before_advantages(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        if self.variant == "m3po":
            rollouts.adv_group = F.chunk_groups(rollouts.group, rollouts.source, self.num_samples)  # [N]
            rollouts.loss_pass = rollouts.source.clone()  # [N]: one loss pass per weight sample
        _, metrics = F.partial_chunk_success(rollouts.rewards > 0, rollouts.group, rollouts.source,
                                             rollouts.num_groups, self.num_samples)
        pl_module.log_metrics(metrics)

    @override
    def loss_context(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts,
                     loss_pass: int) -> AbstractContextManager:
        # C3PO: a fresh sample, index N, unlike every generating one; B3PO/M3PO: the pass's generating sample
        index = self.num_samples if self.variant == "c3po" else loss_pass
        return _gradient_sample(self._ivon(trainer), index)

    @override
    def on_rl_step_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        optimizer = self._ivon(trainer)
        pl_module.log_metrics(optimizer.noise_stats())  # σ after this step; θ − m of the loss sample
        if pl_module.global_step % self.bf16_check_every == 0:
            self._maybe_warn_bf16(pl_module, optimizer)

    def _maybe_warn_snapshot_memory(self, plan: RolloutPlan, nbytes: int, device: torch.device) -> None:
        """Once: the snapshots waiting for the producer (at most lead + 1 plans of `nbytes` each) against the free
        memory of `device`, the module's."""
        if self._memory_checked:
            return
        self._memory_checked = True
        message = snapshot_memory_warning(nbytes, plan.ahead + 1, free_bytes(device))
        if message is not None:
            log.warning(message)

    def _maybe_warn_bf16(self, pl_module: "pl.LightningModule", optimizer: IVON) -> None:
        if self._bf16_warned or engine_dtype(pl_module) != torch.bfloat16:
            return
        message = bf16_spacing_warning(optimizer, trainable_parameters(pl_module.policy))  # LoRA: the adapters
        if message is not None:
            log.warning(message)
            self._bf16_warned = True


def sample_from_posterior(plan: RolloutPlan, optimizer: IVON, num_samples: int) -> None:
    """Make the plan's `num_samples` weight sources IVON's samples θ̂_0 … θ̂_{N−1} of this step."""
    plan.num_weight_sources = num_samples
    # train=False: generating records no gradient sample; m is back in place when the context exits
    plan.weight_context = lambda source: optimizer.sampled_params(sample_index=source)
    params = [p for group in optimizer.param_groups for p in group["params"] if p is not None]
    plan.weight_stacks = lambda num: dict(zip(params, optimizer.sampled_stack(range(num))))  # same bits


def snapshot_posterior(plan: RolloutPlan, optimizer: IVON, num_samples: int, policy: torch.nn.Module) -> int:
    """Make the plan's `num_samples` weight sources IVON's samples θ̂_0 … θ̂_{N−1} of this step, for a producer
    that pushes them to its engine later (the bits `sampled_params(j)` would write now); the policy is never written.
    The batch's version is then the plan's. Returns the bytes the snapshot holds until the batch is generated:
    N > 2 samples are drawn when pushed, from a copy of m and 1/σ (`PosteriorSnapshot`: two copies of the weights
    whatever N); N ≤ 2, or sharded parameters (FSDP2), are drawn now, the shards gathered here in the trainer's
    thread so that the producer's pushes run no collective (N copies of the whole weights)."""
    names = {id(p): name for name, p in policy.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"] if p is not None]
    if num_samples > 2 and not any(hasattr(p, "full_tensor") for p in params):
        snapshot = PosteriorSnapshot(optimizer, num_samples)
        order = [names[id(p)] for p in params]
        plan.source_weights = lambda source: list(zip(order, snapshot.sample(source)))
        nbytes = snapshot.nbytes
    else:
        stacks = optimizer.sampled_stack(range(num_samples))
        named = [(names[id(p)], whole_stack(p, stack)) for p, stack in zip(params, stacks)]
        plan.source_weights = lambda source: [(name, stack[source]) for name, stack in named]
        nbytes = sum(stack.numel() * stack.element_size() for _, stack in named)
    plan.num_weight_sources = num_samples
    plan.source_seeds = [sample_seed(optimizer.seed, optimizer.current_step, j, optimizer.rank, 0)
                         for j in range(num_samples)]
    return nbytes


def snapshot_memory_warning(nbytes: int, plans: int, free: Optional[int]) -> Optional[str]:
    """A warning when `plans` snapshots of `nbytes` each could take more than half of `free` bytes, else None."""
    if free is None or plans * nbytes <= free // 2:
        return None
    return (f"3PO in async mode keeps a snapshot of the posterior per waiting batch ({nbytes / 2**30:.2f} GiB a "
            f"batch, up to {plans} batches: rollout.max_staleness + 1, + 1 with drop) next to the weights, and only "
            f"{free / 2**30:.2f} GiB are free: lower rollout.max_staleness")


def free_bytes(device: torch.device) -> Optional[int]:
    """Free memory of `device` (a GPU's, or the host's for the CPU); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@contextmanager
def _gradient_sample(optimizer: IVON, sample_index: int) -> Iterator[None]:
    """Hold θ̂_{sample_index} over one loss pass; IVON records the pass's gradient on exit."""
    optimizer.zero_grad(set_to_none=True)  # IVON records the .grad held at exit: each sample's gradient once
    with optimizer.sampled_params(sample_index=sample_index, train=True):
        yield


def engine_dtype(pl_module: "pl.LightningModule") -> Optional[torch.dtype]:
    """The dtype the rollout engine generates in: its `dtype` attribute, else its model's, else the policy's."""
    engine = pl_module.engine
    dtype = engine.generation_dtype() if engine is not None else None
    return dtype if dtype is not None else next(pl_module.policy.parameters()).dtype
