"""`OracleBaseline`: how far each method's baseline is from the true expected reward (a measurement, not a method).

V0.5's claim is about the mean squared error of the GRPO baseline (its Theorem 3.1: the baseline MSE amplifies
the policy-gradient variance). This callback measures it during a run. On every `every_n_steps`-th step,
after the method has generated and scored its rollouts and before the optimizer step (so from the *same*
weights), it draws `num_samples` extra completions per prompt and takes their mean reward as the oracle
value μ̂_b of each prompt b. The weights are the plan's weight sources: the mean weights for GRPO and V0.5; for
C3PO the same N IVON samples θ̂_c (re-created from their seeds, not perturbing anything), `num_samples / N`
each, so the oracle is the expected reward of the mixture that generated the group.

At the step's end (when every callback has set its baseline) it compares with the baseline b the advantages
used: `rollouts.baseline` when a callback set it (V0.5's fused baseline), else the group mean of the method's
own rollouts (GRPO, C3PO). The oracle mean has its own noise, so the logged MSE is debiased:

    baseline_mse = mean_b (b_b − μ̂_b)²  −  mean_b s²_b / M
    (s²_b: unbiased sample variance of the M oracle rewards)

which estimates mean_b (b_b − μ_b)² without bias (the oracle draws are independent of the method's, given the
weights). One sampled step of 16 prompts is noisy (it may even be negative): average over sampled steps.

The extra completions are drawn through the module's rollout driver, with the training sampling options, and never
enter the method: they are not in `rollouts`, not counted in the module's `rollouts_total` / `tokens_generated`,
and their engine calls have their own seed keys (run seed, step, "oracle", this callback's seed), so the method's
random stream is unchanged. They do take time: `time/step_s` of a sampled step includes `repro/oracle_s`.

Logged on sampled steps (NaN on the others): `repro/baseline_mse`, `repro/baseline_mse_raw`, `repro/oracle_noise`
(the subtracted term), `repro/group_mean_mse` (debiased MSE of the plain mean of the method's own rollouts, for
comparison with a callback's baseline), `repro/oracle_reward_mean`, `repro/oracle_s`. On every step:
`repro/all_zero_adv_frac`, the fraction of prompts whose advantages are all zero (V0.5's fused baseline gives a group of
equal rewards a nonzero advantage, which `groups/zero_adv_frac`, "all rewards equal", does not see).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lit_rlvr.functional import group_mean
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


def debiased_mse(baseline: Tensor, oracle_mean: Tensor, oracle_var: Tensor,
                 oracle_n: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Unbiased estimate of mean_b (baseline_b − μ_b)² from a noisy oracle mean μ̂_b of `oracle_n` draws.

    baseline, oracle_mean, oracle_var (unbiased sample variance of the draws), oracle_n: [B].
    E[(b − μ̂)²] = (b − μ)² + Var(μ̂) when μ̂ is independent of b, and E[s²/n] = Var(μ̂), so
    mse = mean (b − μ̂)² − mean s²/n. Returns (mse, {"raw": mean (b − μ̂)², "noise": mean s²/n}).
    """
    raw = ((baseline.float() - oracle_mean.float()) ** 2).mean()  # scalar
    noise = (oracle_var.float() / oracle_n.float().clamp_min(1)).mean()  # scalar
    return raw - noise, {"raw": raw.detach(), "noise": noise.detach()}


def group_moments(values: Tensor, group: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mean [B], unbiased variance [B] (0 for groups of one) and count [B] of `values` [N] per group."""
    mean = group_mean(values, group, num_groups)  # [B]
    count = torch.bincount(group, minlength=num_groups).to(values.dtype)  # [B]
    sq = torch.zeros(num_groups, dtype=values.dtype).index_add_(0, group, (values - mean[group]) ** 2)  # [B]
    return mean, sq / (count - 1).clamp_min(1), count


ORACLE_KEYS = ("repro/baseline_mse", "repro/baseline_mse_raw", "repro/oracle_noise", "repro/group_mean_mse",
               "repro/oracle_reward_mean", "repro/oracle_s")


class OracleBaseline(RLVRCallback):
    """Measures the baseline MSE against an oracle of extra rollouts (see the module docstring).

    Args:
        every_n_steps: sample the oracle on steps 0, n, 2n, … (global step before the update).
        num_samples: M, extra completions per prompt on a sampled step; a multiple of the plan's weight
            sources is best (C3PO: split as evenly as possible).
        seed: mixed with the run's seed into the oracle's sampling seeds (never the method's seeds).
    """

    async_refusal = "draws its oracle samples with the step's weights, which the producer's batches were not"

    def __init__(self, every_n_steps: int = 10, num_samples: int = 32, seed: int = 0) -> None:
        super().__init__()
        if every_n_steps < 1 or num_samples < 2:
            raise ValueError(f"OracleBaseline: every_n_steps must be >= 1 and num_samples >= 2 (a variance needs "
                             f"two draws), got {every_n_steps} and {num_samples}")
        self.every_n_steps, self.num_samples, self.seed = every_n_steps, num_samples, seed
        self._plan: Optional[RolloutPlan] = None
        self._plans_this_step = 0
        self._oracle: Optional[dict[str, Any]] = None

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._plan, self._plans_this_step, self._oracle = None, 0, None

    @override
    def on_rollout_plan(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", plan: RolloutPlan) -> None:
        self._plan = plan  # other callbacks edit it in place (weight sources, counts): read it later
        self._plans_this_step += 1

    def sampled(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    @override
    def on_before_advantages(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        if not self.sampled(pl_module.global_step) or self._plan is None:
            return
        if self._plans_this_step != 1 or rollouts.prompts != self._plan.prompts:
            log.warning("OracleBaseline: step %d used %d plans (dynamic sampling?); oracle skipped",
                        pl_module.global_step, self._plans_this_step)
            return
        t0 = time.perf_counter()
        rewards, group = self.draw(pl_module, self._plan)  # [M·B], [M·B]
        mean, var, count = group_moments(rewards, group, self._plan.num_prompts)  # [B] each
        self._oracle = {"mean": mean, "var": var, "count": count, "seconds": time.perf_counter() - t0}

    def draw(self, pl_module: "pl.LightningModule", plan: RolloutPlan) -> tuple[Tensor, Tensor]:
        """M extra rewards per prompt from the plan's weight sources, in one round of the module's rollout driver;
        returns rewards [B·M] and prompt ids [B·M]."""
        oracle = replace(plan, n_per_prompt=[self.num_samples] * plan.num_prompts, budget_rule=None, seed_stream=())
        version = pl_module.source.version  # the weights the engine holds: no push between the step's and these
        result = pl_module.driver.rollout(oracle, step=version, seed_key=(*pl_module.seed_key(), "oracle", self.seed))
        return result.rollouts.rewards.float(), result.rollouts.group

    @override
    def on_rl_step_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        rewards = rollouts.rewards.detach().float().cpu()  # [N]
        group = rollouts.group.cpu()  # [N]
        metrics: dict[str, Tensor] = {}
        if rollouts.advantages is not None:
            moved = (rollouts.advantages.detach().cpu().abs() > 1e-6).float()  # [N]
            nonzero = torch.zeros(rollouts.num_groups).index_add_(0, group, moved)
            metrics["repro/all_zero_adv_frac"] = (nonzero == 0).float().mean()
        # every key on every step (NaN when not sampled): Lightning re-logs a key's last value on steps that do
        # not log it, which would repeat one sampled step's figures over the next n − 1 rows of metrics.csv
        metrics.update({key: torch.tensor(float("nan")) for key in ORACLE_KEYS})
        if self._oracle is not None:
            own_mean = group_mean(rewards, group, rollouts.num_groups)  # [B]
            baseline = rollouts.baseline.detach().float().cpu() if rollouts.baseline is not None else own_mean  # [B]
            o = self._oracle
            mse, parts = debiased_mse(baseline, o["mean"], o["var"], o["count"])
            own_mse, _ = debiased_mse(own_mean, o["mean"], o["var"], o["count"])
            metrics.update({"repro/baseline_mse": mse, "repro/baseline_mse_raw": parts["raw"],
                            "repro/oracle_noise": parts["noise"], "repro/group_mean_mse": own_mse,
                            "repro/oracle_reward_mean": o["mean"].mean(), "repro/oracle_s": torch.tensor(o["seconds"])})
        self._oracle = None
        pl_module.log_metrics(metrics)
