"""`ValuePrior`: V0.5 — a generalist value prior fused with a few rollouts, and OSLA budget allocation.

Paper: "V0.5: Generalist Value Model as a Prior for Sparse RL Rollouts" (the method as this library implements it:
docs/architecture.md §6).
One RL step (docs/architecture.md §3), with B prompts:

    on_rollout_plan       V0 predicts p̂ [B] in context (this run's recent records); prior V = low + (high−low)·p̂
                          (= 2p̂ − 1 for ±1 rewards); first round = k_init samples per prompt; OSLA rule installed
    driver.rollout        after every round the rule re-estimates Δ̂² and asks for one more sample where the
                          expected MSE reduction beats the cost c (Eq. 12), under the batch rules, ≤ k_max
    on_before_advantages  rollouts.baseline = fused baseline b (Eq. 8), so A = r − b (std scaling off by default)
    on_rl_step_end        context += this step's (prompt, success rate, n); v05/* metrics and time/prior_s

Prompt features are a pure function of the prompt text and the frozen backbone, so they are computed ahead, in
large batches, outside the steps (`precompute`): the whole training set at train start ("all"), or the prompts
of the coming steps in the sampler's order, `precompute_max` at a time ("next"); their seconds are logged as
time/prior_setup_s (once) and time/prior_prefetch_s, apart from time/prior_s. A prompt that was not computed
ahead (another sampler, a module that draws extra batches) is embedded in the step, as with "off".

With `rollout.mode=async` each plan keeps its own record (`RolloutPlan.notes`): the batch is planned, and its
prior predicted, steps before it trains, and the budget rule runs in the producer (docs/async.md).

Until the context holds `min_context` records the prior is absent: the baseline is the plain sample mean and
OSLA asks for samples as for the plain mean (every prompt up to k_max with c ≈ 1/256); `v05/prior_present` = 0.
The first round draws k_init samples per prompt (by default the module's `group_size`), OSLA decides the rest.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import Tensor
from typing_extensions import override

from lit_rlvr.algorithms.allocation import ALLOCATIONS, FixedBudget
from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.config.options import check_finite
from lit_rlvr.functional.ranking import binary_auroc_py
from lit_rlvr.functional.value_prior import (
    allocate_round,
    expected_mse_reduction,
    group_mean_py,
    osla_wants_more,
    reward_noise_var,
    round_f32,
    shrinkage_fusion,
)
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from lit_rlvr.run import distributed as D
from lit_rlvr.value import FEATURE_MODES, HEADS, ContextBuffer, ValueModel
from lit_rlvr.value.prefetch import Ahead, TrainPrompts

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

KEY = "algorithm.callbacks.value_prior"  # config path of this callback, for error messages
NOTE = "value_prior"  # its record's key in `RolloutPlan.notes`
PRECOMPUTE_MODES = ("auto", "all", "next", "off")


@dataclass
class _Step:
    """What one RL step carries from the plan to the end of the step. Keyed by prompt text, so a step with
    several plans (dynamic sampling) or a repeated prompt still finds its prior (same text, same prediction)."""

    prior: dict[str, float] = field(default_factory=dict)  # prompt → V on the reward scale (NaN: absent)
    p_hat: dict[str, float] = field(default_factory=dict)  # prompt → p̂ in [0, 1] (NaN: absent)
    present: bool = False
    context_size: int = 0
    rounds: int = 0
    prior_s: float = 0.0  # prediction + allocation + fusion + context bookkeeping (its budget: ≤ 5% of a step)
    fusion: dict[str, list] = field(default_factory=dict)  # shrinkage_fusion's metrics [B] each
    stats: Optional[tuple[tuple, tuple[list, list], tuple[list, list]]] = None  # see ValuePrior._group_stats
    prior_version: Optional[int] = None  # async mode: the context's version (updates whose records it held)


class ValuePrior(RLVRCallback):
    """V0.5 for any `GRPOModule` (see the module docstring for the step).

    Args:
        k_init: samples per prompt in the first round (paper: 4); None = the module's `group_size`.
        k_max: never more samples than this per prompt (paper: 16).
        cost: OSLA's price c of one more sample, in baseline MSE on the ±1 reward scale (paper: 0.0039 ≈ 1/256);
            other reward ranges scale it by ((high − low)/2)², so the same c stops at the same count.
        min_active_frac: keep generating rounds only while this fraction of the batch asks for more (paper: 0.25).
        pad_to: pad each extra round to a multiple of this many sequences (paper: 32); the padding goes to the
            prompts with the largest expected MSE reduction.
        round_size: extra samples per asking prompt per round *(inferred: 1)*.
        reward_range: (low, high) of the reward; the prior and success rates are mapped onto it.
        noise_var: σ² of Eq. 8/12; None = worst case for the range, (high − low)²/4 (= 1 for ±1 rewards).
        context_size, min_context: the context buffer of V0 (records kept; below min_context the prior is absent).
        backbone, head, head_kwargs, features, adapter_path, max_length, device, seed, bandwidth_refit: V0,
            see `lit_rlvr.value.ValueModel.create`; `device` None = the policy's device (the strategy's root
            device). Built in `setup`.
            bandwidth_refit (default 0.25): the kernel head searches its bandwidth again once this fraction
            of the context is new since its last search (0 = at every step).
        precompute: when prompt features are computed (see the module docstring): "all" the training set at
            train start; "next" the coming `precompute_max` prompts in the sampler's order (needs the data
            module's ResumableSampler or a sequential one; a chunk never covers more than the run's max_steps);
            "off" in the step, when first seen; "auto" (default) "all" when the training set is no larger than
            both `precompute_max` and what the run draws, else "next" where the order is known, else "off".
        precompute_max: most prompts computed ahead at once (and held: F floats each).
        precompute_batch: prompts per backbone call when computing ahead.
        value_model: a ready V0 (anything with `predict(prompts, context) -> (p̂ [B] | None, metrics)`);
            when given, the V0 arguments above are not used.
        allocation: who decides the samples after the first round: "osla" (the paper's Eq. 12), or one of its
            rivals at a fixed mean of `mean_rollouts` samples per prompt, "uniform" (the same for every prompt) or
            "beta" (Beta-posterior allocation from each prompt's history): lit_rlvr/algorithms/allocation.py.
            The fusion (Eq. 8) is the same under every rule.
        mean_rollouts: the fixed rules' mean samples per prompt, in [k_init, k_max]; null with "osla".
    """

    sets_sample_counts = True  # k_init and OSLA decide how many samples each prompt gets
    sets_baseline = True  # the fused baseline (Eq. 8)

    def __init__(
        self,
        k_init: Optional[int] = None,
        k_max: int = 16,
        cost: float = 0.0039,
        min_active_frac: float = 0.25,
        pad_to: int = 32,
        round_size: int = 1,
        reward_range: Sequence[float] = (-1.0, 1.0),
        noise_var: Optional[float] = None,
        context_size: int = 256,
        min_context: int = 32,
        backbone: str = "minilm",
        head: str = "kernel",
        head_kwargs: Optional[dict[str, Any]] = None,
        features: str = "auto",
        adapter_path: Optional[str] = None,
        max_length: int = 128,
        device: Optional[str] = None,
        seed: int = 0,
        bandwidth_refit: float = 0.25,
        precompute: str = "auto",
        precompute_max: int = 8192,
        precompute_batch: int = 256,
        value_model: Any = None,
        allocation: str = "osla",
        mean_rollouts: Optional[float] = None,
    ) -> None:
        super().__init__()
        check_finite(KEY, cost=cost, min_active_frac=min_active_frac, reward_range=reward_range, noise_var=noise_var,
                     bandwidth_refit=bandwidth_refit, head_kwargs=head_kwargs, mean_rollouts=mean_rollouts)
        _check_budget(1 if k_init is None else k_init, k_max, cost, min_active_frac, pad_to, round_size)
        self.low, self.high, self.noise_var = _check_rewards(reward_range, noise_var)
        if not 1 <= min_context <= context_size:
            raise ValueError(f"{KEY}.min_context must be in [1, {KEY}.context_size]; got min_context={min_context}, "
                             f"context_size={context_size}")
        if value_model is None and head not in HEADS:
            raise ValueError(f"{KEY}.head={head!r} is not valid; valid: {', '.join(sorted(HEADS))}")
        if value_model is None and features not in FEATURE_MODES:
            raise ValueError(f"{KEY}.features={features!r} is not valid; valid: {', '.join(FEATURE_MODES)}")
        if precompute not in PRECOMPUTE_MODES:
            raise ValueError(f"{KEY}.precompute={precompute!r} is not valid; valid: {', '.join(PRECOMPUTE_MODES)}")
        if precompute_max < 1 or precompute_batch < 1:
            raise ValueError(f"{KEY}.precompute_max and {KEY}.precompute_batch must be >= 1, got {precompute_max}, "
                             f"{precompute_batch}")
        if not 0.0 <= bandwidth_refit <= 1.0:
            raise ValueError(f"{KEY}.bandwidth_refit must be in [0, 1], got {bandwidth_refit}")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"{KEY}.allocation={allocation!r} is not valid; valid: {', '.join(ALLOCATIONS)}")
        if (allocation == "osla") != (mean_rollouts is None):
            raise ValueError(f"{KEY}.mean_rollouts={mean_rollouts!r} with {KEY}.allocation={allocation}: a number "
                             f"in [k_init, k_max] for uniform or beta, null for osla (OSLA decides its own count)")
        if mean_rollouts is not None and (isinstance(mean_rollouts, bool)
                                          or not isinstance(mean_rollouts, (int, float))):
            raise ValueError(f"{KEY}.mean_rollouts={mean_rollouts!r} must be a number (samples per prompt) or null")
        if mean_rollouts is not None and not (1 if k_init is None else k_init) <= mean_rollouts <= k_max:
            raise ValueError(f"{KEY}.mean_rollouts={mean_rollouts} must be in [k_init, k_max] = "
                             f"[{k_init if k_init is not None else 'group_size'}, {k_max}]")
        self.allocation = allocation
        self._budget = FixedBudget(allocation, mean_rollouts, k_max=k_max) if mean_rollouts is not None else None
        if not max_length >= 1:  # the backbone's tokens per prompt: 0 would embed nothing
            raise ValueError(f"{KEY}.max_length={max_length} must be >= 1 (prompt tokens the backbone reads)")
        self.precompute, self.precompute_max, self.precompute_batch = precompute, precompute_max, precompute_batch
        self.k_init, self.k_max, self.cost = k_init, k_max, cost  # k_init None: the module's group_size
        self._k_init_given = k_init is not None
        self._warned_options = False
        # c is a price in baseline MSE on the ±1 scale; MSE scales with the square of the reward range
        self._cost_f32 = round_f32(cost * ((self.high - self.low) / 2) ** 2)
        self.min_active_frac, self.pad_to, self.round_size = min_active_frac, pad_to, round_size
        self.context = ContextBuffer(capacity=context_size, min_context=min_context)
        self.value_model_kwargs = dict(backbone=backbone, head=head, head_kwargs=head_kwargs, features=features,
                                       adapter_path=adapter_path, max_length=max_length, device=device, seed=seed,
                                       bandwidth_refit=bandwidth_refit)
        self.value_model = value_model
        self._step: Optional[_Step] = None  # synchronous mode: this step's record (async: each plan's, in its notes)
        self._restored_cache_keys: list[str] = []
        self._restored_features: dict[str, Tensor] = {}
        self._restored_head: dict[str, Any] = {}
        self._ahead: Optional[Ahead] = None  # "next": where the coming prompts come from
        self._ahead_s = {"setup": 0.0, "prefetch": 0.0}  # seconds computing features ahead, not yet logged

    # -- Lightning hooks -------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and self.value_model is None:
            # built here, not in __init__: loading the backbone is not part of any step's time
            kwargs = dict(self.value_model_kwargs)
            # the strategy's device: Lightning calls this hook before it moves the module there
            kwargs["device"] = kwargs["device"] or str(trainer.strategy.root_device)
            self.value_model = ValueModel.create(**kwargs)
            self._restore_backbone_cache()

    @override
    def check_algorithm(self, algorithm: AlgorithmConfig) -> None:
        if not self._k_init_given:
            self.k_init = algorithm.group_size
            _check_budget(self.k_init, self.k_max, self.cost, self.min_active_frac, self.pad_to, self.round_size)
            if self._budget is not None and self._budget.mean_rollouts < self.k_init:
                raise ValueError(f"{KEY}.mean_rollouts={self._budget.mean_rollouts} is below k_init={self.k_init} "
                                 "(algorithm.group_size): the first round alone draws more")
        if not self._warned_options:
            self._warned_options = _warn_unused_settings(algorithm, self.k_init)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not hasattr(self.value_model, "precompute") or self.precompute == "off":
            return
        source = TrainPrompts.of(trainer, pl_module)
        mode = self._resolve_precompute(source, trainer.max_steps)
        if mode == "all":
            seconds = self.value_model.precompute(source.prompts(range(len(source))), self.precompute_batch)
            self._ahead_s["setup"] += seconds
            log.info("V0.5: features of all %d training prompts computed ahead in %.1f s", len(source), seconds)
        elif mode == "next":
            steps = self.precompute_max // source.batch_size
            steps = max(1, min(steps, trainer.max_steps) if trainer.max_steps and trainer.max_steps > 0 else steps)
            self._ahead = Ahead(source, steps)
            log.info("V0.5: features computed ahead %d steps (%d prompts) at a time", steps, steps * source.batch_size)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._step = None  # a step that raised half-way must not leak its prior into this one
        if self._ahead is not None:
            prompts = self._ahead.chunk_for(trainer.current_epoch, batch_idx)  # None: this chunk is held already
            if prompts is not None:
                self._ahead_s["prefetch"] += self.value_model.precompute(prompts, self.precompute_batch)

    def _resolve_precompute(self, source: Optional["TrainPrompts"], max_steps: int) -> str:
        """"auto" → "all" | "next" | "off" for this training set (see the class docstring)."""
        if source is None:
            if self.precompute != "auto":
                log.warning("V0.5: %s.precompute=%s needs a train dataloader with a dataset of {'prompt': ...} "
                            "rows; features are computed in the steps", KEY, self.precompute)
            return "off"
        if self.precompute == "next" and source.order is None:
            log.warning("V0.5: %s.precompute=next needs the data module's ResumableSampler (or a sequential "
                        "one) to know the coming prompts; features are computed in the steps", KEY)
            return "off"
        if self.precompute != "auto":
            return self.precompute
        drawn = max_steps * source.batch_size if max_steps and max_steps > 0 else math.inf
        if len(source) <= min(self.precompute_max, drawn):
            return "all"
        if source.order is not None:
            return "next"
        return "all" if len(source) <= self.precompute_max else "off"

    @override
    def on_rollout_plan(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", plan: RolloutPlan) -> None:
        t0 = time.perf_counter()
        if plan.budget_rule is not None:
            raise RuntimeError("ValuePrior: another callback already set the plan's budget_rule; V0.5's OSLA rule "
                               "cannot be combined with it (remove one of the two callbacks)")
        if plan.ahead is not None:  # planned ahead: the batch keeps its own record
            # the context holds the records of the plan's `version` updates
            step = plan.notes[NOTE] = _Step(context_size=len(self.context), prior_version=plan.version)
        else:
            step = self._step if self._step is not None else _Step(context_size=len(self.context))
            self._step = step  # a second plan in the same step (dynamic sampling) adds to the same record
        p_hat = self._predict(plan.prompts)  # [B] or None
        step.present = p_hat is not None
        prior = self.to_reward_scale(p_hat) if p_hat is not None else torch.full((plan.num_prompts,), math.nan)  # [B]
        step.prior.update(zip(plan.prompts, prior.tolist()))
        step.p_hat.update(zip(plan.prompts, p_hat.tolist() if p_hat is not None else [math.nan] * plan.num_prompts))
        plan.n_per_prompt = [self.k_init] * plan.num_prompts
        prior_list = prior.tolist()  # [B] float32 values, once for all rounds
        if self._budget is None:
            plan.budget_rule = lambda rollouts: self._next_round(rollouts, prior_list, step)  # async: in the producer
        else:  # a fixed-budget rival of OSLA: one more round, from the history as it is now
            history = self._budget.snapshot(plan.prompts)
            plan.budget_rule = lambda rollouts: self._fixed_round(rollouts, history, step)
        step.prior_s += time.perf_counter() - t0

    @override
    def on_before_advantages(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        t0 = time.perf_counter()
        step = self._step_of(rollouts)
        mean, counts = self._group_stats(rollouts, step)  # [B] float32 values, [B] ints
        prior = [step.prior.get(p, math.nan) for p in rollouts.prompts]  # [B] float32 values
        baseline, step.fusion = shrinkage_fusion(mean, prior, counts, self.noise_var)  # [B]
        rollouts.baseline = torch.tensor(baseline, dtype=torch.float32)
        if step.prior_version is not None:
            rollouts.prior_version = torch.full((rollouts.num_samples,), step.prior_version, dtype=torch.long)  # [N]
        step.prior_s += time.perf_counter() - t0

    @override
    def on_rl_step_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        t0 = time.perf_counter()
        step = self._step_of(rollouts)
        self._step = None
        mean, counts = self._group_stats(rollouts, step)  # [B] float32 values, [B] ints
        success = self._to_success_rate_py(mean)  # [B] float32 values (= to_success_rate)
        metrics = self._metrics(step, rollouts, success, counts)
        self.context.add(rollouts.prompts, success, counts)  # after the metrics: they judge the prior as predicted
        if self._budget is not None:
            self._budget.observe(rollouts.prompts, mean, counts, low=self.low, high=self.high)
        step.stats = None  # let go of this step's rollouts
        step.prior_s += time.perf_counter() - t0
        ahead = {f"time/prior_{k}_s": torch.tensor(v) for k, v in self._ahead_s.items() if v or k == "prefetch"}
        self._ahead_s = {"setup": 0.0, "prefetch": 0.0}
        pl_module.log_metrics({**metrics, "time/prior_s": torch.tensor(step.prior_s), **ahead})

    # -- state -------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (`_rank_state`); with several ranks, every rank's in rank order under "ranks": each
        rank's context holds its own prompts' records, and rank 0 alone writes the checkpoint. Called on every
        rank at each save (Lightning's checkpoint dump is collective)."""
        own = self._rank_state()
        return own if D.world_size() == 1 else {"ranks": D.all_gather_object(own)}

    def _rank_state(self) -> dict[str, Any]:
        """The context records and the prompts whose embeddings are cached (the states are recomputed on
        demand after a resume; the keys let a persistent backbone cache refill, and a resume be checked)."""
        features = getattr(self.value_model, "feature_state", lambda prompts: {})(self.context.prompts)
        head = getattr(self.value_model, "head_state", dict)()
        keys = list(dict.fromkeys(self._cache_keys() + list(features)))  # token states or features held
        return {"context": self.context.state_dict(), "embedding_cache_keys": keys,
                "context_features": {p: f.cpu() for p, f in features.items()}, "head_state": head,
                **({"allocation": self._budget.state_dict()} if self._budget is not None else {})}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "ranks" in state_dict:
            state_dict = _state_for_this_rank(state_dict["ranks"])
        self.context.load_state_dict(state_dict["context"])
        self._restored_cache_keys = list(state_dict.get("embedding_cache_keys", []))
        self._restored_features = dict(state_dict.get("context_features", {}))
        self._restored_head = dict(state_dict.get("head_state", {}))
        if self._budget is not None:
            self._budget.load_state_dict(state_dict.get("allocation", {}))
        self._restore_backbone_cache()

    def _cache_keys(self) -> list[str]:
        backbone = getattr(self.value_model, "backbone", None)
        keys = backbone.state_dict()["cached_prompts"] if hasattr(backbone, "state_dict") else []
        return keys or list(self._restored_cache_keys)

    def _restore_backbone_cache(self) -> None:
        backbone = getattr(self.value_model, "backbone", None)
        if self._restored_cache_keys and hasattr(backbone, "load_state_dict"):
            backbone.load_state_dict({"cached_prompts": self._restored_cache_keys})
        if self._restored_features and hasattr(self.value_model, "load_feature_state"):
            self.value_model.load_feature_state(self._restored_features)
        if self._restored_head and hasattr(self.value_model, "load_head_state"):
            self.value_model.load_head_state(self._restored_head)

    # -- the pieces ----------------------------------------------------------------------------------------------
    def to_reward_scale(self, p_hat: Tensor) -> Tensor:
        """Success probability [B] → expected reward [B] (V = 2p̂ − 1 for ±1 rewards)."""
        return self.low + (self.high - self.low) * p_hat.detach().float().cpu()

    def to_success_rate(self, mean_reward: Tensor) -> Tensor:
        """Mean reward [B] → success rate [B] in [0, 1] (for ±1 rewards: (r̄ + 1) / 2)."""
        return ((mean_reward - self.low) / (self.high - self.low)).clamp(0, 1)

    def _to_success_rate_py(self, mean_reward: list[float]) -> list[float]:
        """`to_success_rate` on float32 values (same operations, same bits), [B]."""
        low, span = round_f32(self.low), round_f32(self.high - self.low)
        return [min(max(round_f32(round_f32(m - low) / span), 0.0), 1.0) for m in mean_reward]

    def _predict(self, prompts: list[str]) -> Optional[Tensor]:
        """p̂ [B] from V0 fit on the context, or None while the context is short (prior absent)."""
        if not self.context.is_ready:
            return None
        if self.value_model is None:
            raise RuntimeError("ValuePrior: no value model; the trainer's setup() builds it (or pass value_model=)")
        if isinstance(self.value_model, ValueModel):  # its metrics are not logged here: skip them
            p_hat, _ = self.value_model.predict(prompts, self.context, with_metrics=False)
        else:  # any model with predict(prompts, context)
            p_hat, _ = self.value_model.predict(prompts, self.context)
        return None if p_hat is None else p_hat.detach().float().cpu()

    def _next_round(self, rollouts: Rollouts, prior: list[float], step: _Step) -> Optional[list[int]]:
        """The plan's budget rule: extra samples per prompt for the next round (OSLA, Eq. 12), None = stop.

        `expected_mse_reduction`, `osla_wants_more` and `allocate_round` of `lit_rlvr.functional.value_prior`, in
        plain Python on float32 values: B is a few dozen numbers, where each torch call's overhead is the cost.
        In async mode the producer calls it: it reads only the plan's own `step` and settings fixed at build."""
        t0 = time.perf_counter()
        step.rounds += 1  # called once after every round
        mean, counts = self._group_stats(rollouts, step)  # [B] float32 values, [B] ints
        gain = expected_mse_reduction(mean, prior, counts, self.noise_var)  # [B] Δ̂² re-estimated
        wants = osla_wants_more(gain, counts, cost=self._cost_f32, k_max=self.k_max)  # [B]
        extra = allocate_round(wants, gain, counts, k_max=self.k_max, min_active_frac=self.min_active_frac,
                               pad_to=self.pad_to, round_size=self.round_size)  # [B]
        step.prior_s += time.perf_counter() - t0
        return extra if sum(extra) > 0 else None

    def _fixed_round(self, rollouts: Rollouts, history: list[tuple[float, float]], step: _Step) -> Optional[list[int]]:
        """The budget rule of a fixed-budget allocation (`FixedBudget`): one extra round, then stop."""
        if step.rounds:
            return None
        t0 = time.perf_counter()
        step.rounds += 1
        mean, counts = self._group_stats(rollouts, step)  # [B] float32 values, [B] ints
        extra = self._budget.extra(counts, mean, history, low=self.low, high=self.high)
        step.prior_s += time.perf_counter() - t0
        return extra

    def _group_stats(self, rollouts: Rollouts, step: _Step) -> tuple[list[float], list[int]]:
        """Each prompt's sample mean reward and count (`group_mean_py`), computed once per rollouts state: the
        last round's rule, the fusion and the step end all see the same final rollouts. Keyed on the rewards and
        group tensors themselves, their in-place version counters and B, so any change recomputes; kept in the
        plan's record `step`. The lists are shared: read them, never write."""
        rewards, group = rollouts.rewards, rollouts.group
        key = (rewards, group, getattr(rewards, "_version", None), getattr(group, "_version", None),
               rollouts.num_groups)
        held = step.stats
        if held is not None and held[0][0] is key[0] and held[0][1] is key[1] and held[0][2:] == key[2:]:
            return held[1]
        values = rewards.detach().float().tolist(), group.tolist()  # [N] float32 values, [N] ints
        stats = group_mean_py(*values, rollouts.num_groups)
        step.stats = (key, stats, values)
        return stats

    def _metrics(self, step: _Step, rollouts: Rollouts, success: list[float], counts: list[int]) -> dict[str, Tensor]:
        """v05/* metrics, in plain Python (a handful of [B] lists: a tensor op's overhead would dominate)."""
        nan = math.nan
        p_hat = [step.p_hat.get(p, nan) for p in rollouts.prompts]  # [B] float32 values, NaN where absent
        has = [math.isfinite(p) for p in p_hat]  # [B]
        any_prior, all_prior = any(has), all(has)
        rewards, group = step.stats[2]  # [N], [N] of the rollouts `_group_stats` last read
        fusion = step.fusion
        mid = (self.low + self.high) / 2
        where_prior = lambda values: [v for v, h in zip(values, has) if h]  # noqa: E731
        metrics = {
            "v05/prior_present": float(step.present),
            "v05/context_size": float(step.context_size),
            "v05/rollouts_per_prompt": _mean(counts),
            "v05/rounds": float(step.rounds),
            "v05/w_mean": _mean(fusion["w"]) if fusion else nan,
            # prior-vs-outcome metrics only exist where there was a prior (NaN in the absent phase)
            "v05/prior_rejected_frac": _mean(where_prior(fusion["prior_rejected"])) if any_prior else nan,
            "v05/prior_abs_err": _mean(where_prior([abs(p - s) for p, s in zip(p_hat, success)])) if any_prior else nan,
            "v05/prior_auc": binary_auroc_py([p_hat[g] for g in group],
                                             [r > mid for r in rewards]) if all_prior else nan,
            "v05/p_hat_mean": _mean(where_prior(p_hat)) if any_prior else nan,
        }
        values = torch.tensor(list(metrics.values()), dtype=torch.float32)  # one tensor, not nine
        return dict(zip(metrics, values.unbind()))  # [] each, float32

    def _step_of(self, rollouts: Rollouts) -> _Step:
        """The record of the plan that generated `rollouts`: its own in async mode, else this step's."""
        if rollouts.plan_notes is None:
            return self._require_step()
        if NOTE not in rollouts.plan_notes:
            raise RuntimeError("ValuePrior: the batch's plan holds no V0.5 record (on_rollout_plan did not run on it)")
        return rollouts.plan_notes[NOTE]

    def _require_step(self) -> _Step:
        if self._step is None:
            raise RuntimeError("ValuePrior: on_rollout_plan was not called for this step (the module must call "
                               "the RLVRCallback hooks in order: plan, advantages, step end)")
        return self._step


def _mean(values: Sequence[float]) -> float:
    """Mean of a few values (float64, as a float; NaN when empty)."""
    return math.fsum(values) / len(values) if len(values) else math.nan


def _state_for_this_rank(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """This rank's part of a multi-rank checkpoint. Resumed on another number of ranks, every rank takes all
    the ranks' records (joined in rank order; the buffer keeps the newest `context_size`), and the kernel head
    searches its bandwidth anew: no saved search was made on that context."""
    if len(ranks) == D.world_size():
        return ranks[D.rank()]
    log.warning("V0.5: the checkpoint was written by %d ranks and this run has %d: every rank starts from the "
                "records of all %d (%s)", len(ranks), D.world_size(), len(ranks), KEY)
    contexts = [r["context"] for r in ranks]
    joined = lambda key: [v for c in contexts for v in c[key]]  # noqa: E731
    return {
        "context": {**contexts[0], "prompts": joined("prompts"), "success_rate": joined("success_rate"),
                    "counts": joined("counts"), "total_added": sum(c["total_added"] for c in contexts)},
        "embedding_cache_keys": list(dict.fromkeys(k for r in ranks for k in r["embedding_cache_keys"])),
        "context_features": {p: f for r in ranks for p, f in r["context_features"].items()},
        "head_state": {},
    }


def _check_budget(k_init: int, k_max: int, cost: float, min_active_frac: float, pad_to: int, round_size: int) -> None:
    if k_init < 1:
        raise ValueError(f"{KEY}.k_init must be >= 1, got {k_init}")
    if k_init > k_max:
        raise ValueError(f"{KEY}.k_init={k_init} is larger than {KEY}.k_max={k_max}; set k_init <= k_max")
    if cost < 0:
        raise ValueError(f"{KEY}.cost must be >= 0, got {cost}")
    if not 0.0 <= min_active_frac <= 1.0:
        raise ValueError(f"{KEY}.min_active_frac must be in [0, 1], got {min_active_frac}")
    if pad_to < 1 or round_size < 1:
        raise ValueError(f"{KEY}.pad_to and {KEY}.round_size must be >= 1, got {pad_to}, {round_size}")


def _check_rewards(reward_range: Sequence[float], noise_var: Optional[float]) -> tuple[float, float, float]:
    if len(reward_range) != 2 or not reward_range[0] < reward_range[1]:
        raise ValueError(f"{KEY}.reward_range must be [low, high] with low < high, got {list(reward_range)}")
    low, high = float(reward_range[0]), float(reward_range[1])
    if noise_var is not None and not noise_var > 0:
        raise ValueError(f"{KEY}.noise_var must be > 0 (or null: from reward_range), got {noise_var}")
    return low, high, float(noise_var) if noise_var is not None else reward_noise_var(low, high)


def _warn_unused_settings(algorithm: AlgorithmConfig, k_init: int) -> bool:
    """Say so when an algorithm setting the user may have set has no effect, or departs from the paper, under V0.5;
    returns whether it said anything."""
    warned = False
    if algorithm.group_size != k_init:
        log.warning("V0.5: algorithm.group_size=%s is not used; %s.k_init=%d samples per prompt start each step "
                    "and OSLA adds more", algorithm.group_size, KEY, k_init)
        warned = True
    if algorithm.scale_adv_by_std:
        warned = True
        log.warning("V0.5 with algorithm.scale_adv_by_std=true divides A = r − b by the group's reward std; the "
                    "paper uses the fused baseline alone (algorithm.scale_adv_by_std=false)")
    return warned
