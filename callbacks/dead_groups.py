"""`DeadGroupProbe`: does weight noise rescue dead groups more often than a hotter temperature? (a measurement)

3PO's claim about exploration is counted on "dead" groups: prompts whose G completions are all wrong, so GRPO's
advantages are all zero and the prompt teaches nothing. On every `every_n_steps`-th step, before the update (the
step's own weights), this callback draws, for each of the step's prompts, G completions in each of four arms:

    mean      the mean weights m at the training temperature: a prompt is *dead* when none of its G is correct
    again     m at the same temperature, a second independent draw: what chance alone rescues
    weights   C3PO's exploration: G/N completions from each of N IVON weight samples θ̂_j (the step's own samples;
              needs the IVON optimizer)
    hot       m at `hot_temperature`: the action-space alternative

and logs, over the dead prompts, the share that each other arm *rescues* (at least one correct completion of G),
and each arm's malformed share. A dead prompt has a low success rate, so a second draw rescues some of them by
chance: the `again` arm is the floor both exploration arms are read against.

Like `OracleBaseline`, the draws go through the module's rollout driver with seed keys of their own (run seed,
step, "dead", arm, this callback's seed) and never enter the method: not in `rollouts`, not counted in
`rollouts_total`, and the method's random stream is unchanged. Logged on sampled steps (NaN on the others):
`dead/frac` (dead prompts over all), `dead/rescued_again`, `dead/rescued_weights`, `dead/rescued_hot`,
`dead/malformed_<arm>` for each arm, `dead/probe_s`.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.optim import IVON
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts

from .param_noise import ParamNoise, sample_from_posterior

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

ARMS = ("mean", "again", "weights", "hot")
DEAD_KEYS = ("dead/frac", *(f"dead/rescued_{arm}" for arm in ARMS[1:]), *(f"dead/malformed_{arm}" for arm in ARMS),
             "dead/probe_s")


def any_correct(correct: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """[B] bool: prompt b has at least one correct completion among `correct` [M] (prompt ids `group` [M])."""
    return torch.zeros(num_groups, dtype=torch.long).index_add_(0, group, correct.long()) > 0


def rescued_share(dead: Tensor, rescued: Tensor) -> float:
    """Share of the dead prompts (`dead` [B] bool) that an arm rescued (`rescued` [B] bool); NaN when none is dead."""
    count = int(dead.sum())
    return float((dead & rescued).sum()) / count if count else math.nan


class DeadGroupProbe(RLVRCallback):
    """Counts dead groups and what rescues them (see the module docstring).

    Args:
        every_n_steps: probe on steps 0, n, 2n, … (global step before the update).
        hot_temperature: the `hot` arm's sampling temperature (the training one is `algorithm.temperature`).
        num_samples: N, the weight samples of the `weights` arm; None: a `ParamNoise` callback's, else 4.
        seed: mixed with the run's seed into the probe's sampling seeds (never the method's seeds).
    """

    async_refusal = "draws its probes with the step's weights, which the producer's batches were not"

    def __init__(self, every_n_steps: int = 10, hot_temperature: float = 1.5, num_samples: Optional[int] = None,
                 seed: int = 0) -> None:
        super().__init__()
        if every_n_steps < 1 or not math.isfinite(hot_temperature) or hot_temperature <= 0:
            raise ValueError(f"DeadGroupProbe: every_n_steps must be >= 1 and hot_temperature a finite number > 0, "
                             f"got {every_n_steps} and {hot_temperature}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"DeadGroupProbe: num_samples must be >= 1 or null, got {num_samples}")
        self.every_n_steps, self.hot_temperature, self.seed = every_n_steps, hot_temperature, seed
        self.num_samples = num_samples
        self._plan: Optional[RolloutPlan] = None
        self._metrics: Optional[dict[str, float]] = None
        self._group_size = 0

    @override
    def check_algorithm(self, algorithm: AlgorithmConfig) -> None:
        self._group_size = algorithm.group_size  # G: each arm draws as many completions as the method does

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._plan, self._metrics = None, None

    @override
    def on_rollout_plan(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", plan: RolloutPlan) -> None:
        self._plan = self._plan or plan  # the step's first plan (its prompts)

    @override
    def on_before_advantages(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        if pl_module.global_step % self.every_n_steps or self._plan is None:
            return
        t0 = time.perf_counter()
        plan, size = self._plan, self._group_size
        base = RolloutPlan(plan.prompts, plan.answers, plan.prompt_token_ids, [size] * plan.num_prompts)
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        arms: dict[str, Optional[RolloutPlan]] = {"mean": base, "again": base, "weights": None, "hot": base}
        if isinstance(optimizer, IVON):
            arms["weights"] = replace(base)
            sample_from_posterior(arms["weights"], optimizer, self._weight_samples(trainer))
        metrics: dict[str, float] = {}
        dead = None
        for index, (arm, arm_plan) in enumerate(arms.items()):
            if arm_plan is None:
                metrics[f"dead/rescued_{arm}"] = metrics[f"dead/malformed_{arm}"] = math.nan
                continue
            drawn = self._draw(pl_module, arm_plan, index, self.hot_temperature if arm == "hot" else None)
            correct = any_correct(drawn.rewards > 0, drawn.group, plan.num_prompts)  # [B]
            malformed = drawn.malformed if drawn.malformed is not None else torch.zeros(len(drawn.rewards))
            metrics[f"dead/malformed_{arm}"] = float(malformed.float().mean())
            if dead is None:
                dead = ~correct
                metrics["dead/frac"] = float(dead.float().mean())
            else:
                metrics[f"dead/rescued_{arm}"] = rescued_share(dead, correct)
        metrics["dead/probe_s"] = time.perf_counter() - t0
        self._metrics = metrics

    def _weight_samples(self, trainer: "pl.Trainer") -> int:
        if self.num_samples is not None:
            return self.num_samples
        noise = [c for c in trainer.callbacks if isinstance(c, ParamNoise)]
        return noise[0].num_samples if noise else 4

    def _draw(self, pl_module: "pl.LightningModule", plan: RolloutPlan, arm: int,
              temperature: Optional[float]) -> Rollouts:
        driver = pl_module.driver
        sampling = driver.sampling
        if temperature is not None:
            driver.sampling = replace(sampling, temperature=temperature)
        try:
            key = (*pl_module.seed_key(), "dead", arm, self.seed)
            return driver.rollout(plan, step=pl_module.source.version, seed_key=key).rollouts  # the step's weights
        finally:
            driver.sampling = sampling

    @override
    def on_rl_step_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        # every key on every step (NaN when not probed): Lightning would repeat a probed step's values otherwise
        metrics = {key: math.nan for key in DEAD_KEYS} | (self._metrics or {})
        pl_module.log_metrics({key: torch.tensor(value) for key, value in metrics.items()})
        self._metrics = None
