"""`PromptHistory`: each prompt's own reward history, for DBB's advantage baseline and for boundary gating.

The part a fit adds when `algorithm.advantages=dbb` or `algorithm.boundary_gating=true` (`history_parts`, from the
module's `configure_callbacks`). Per prompt, keyed by its text (what the data gives: the same prompt has the same
text in every epoch, on every rank and after a resume), it keeps DBB's discounted Beta posterior (α, β) and whether
a success was ever observed. In a step, with B prompts:

    on_before_advantages  DBB: the posterior updated with this step's outcomes (`functional.discounted_beta_update`)
                          gives each prompt's mean reward μ as `rollouts.baseline`; `functional.dbb_advantages`
                          scales r − μ by the posterior's std. Gating: `rollouts.update_groups` = no success observed
                          before this step, so a prompt's first successes still teach and later steps do not.
    on_rl_step_end        the step's posteriors and successes become the history (after the update: a step that
                          fails half-way changes nothing); history/* metrics

The history is a Lightning callback's state, so every checkpoint holds it and a resume continues it exactly; with
several ranks each rank's step outcomes are gathered at the step's end, so every rank holds the same history. With
`rollout.mode=async` the hooks run when the batch trains, in the trainer's thread, in the run's batch order.
Equations and our reading of the papers: lit_rlvr/functional/prompt_history.py, docs/algorithms.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from typing_extensions import override

from lit_rlvr import functional as F
from lit_rlvr.config.settings import AlgorithmConfig, HistoryOptions
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.run import distributed as D

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl


def history_parts(algorithm: AlgorithmConfig) -> list["PromptHistory"]:
    """The history part a run with these settings needs ([] when neither DBB nor the gate is on)."""
    return [PromptHistory(algorithm.history, dbb=algorithm.advantages == "dbb")] if algorithm.uses_history else []


class PromptHistory(RLVRCallback):
    """Each prompt's reward history (see the module docstring).

    Args:
        options: `HistoryOptions` (γ, the prior, whether to gate).
        dbb: set `rollouts.baseline` to the posterior mean (`algorithm.advantages=dbb`).
        reward_range: (low, high) of the binary reward; success = above the middle.
    """

    def __init__(self, options: HistoryOptions = HistoryOptions(), *, dbb: bool = True,
                 reward_range: tuple[float, float] = (-1.0, 1.0)) -> None:
        super().__init__()
        self.options, self.dbb = options, dbb
        self.sets_baseline = dbb
        self.low, self.high = float(reward_range[0]), float(reward_range[1])
        self.records: dict[str, list[float]] = {}  # prompt → [α, β, solved (0/1)]
        self._pending: Optional[dict[str, list[float]]] = None  # this step's new records, kept at its end
        self._metrics: dict[str, float] = {}

    def record(self, prompt: str) -> tuple[float, float, bool]:
        """(α, β, solved before) of a prompt; the prior and False for one never seen."""
        alpha, beta, solved = self.records.get(prompt, (self.options.dbb_prior_alpha, self.options.dbb_prior_beta, 0))
        return alpha, beta, bool(solved)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._pending = None  # a step that raised half-way keeps nothing

    @override
    def on_before_advantages(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        if self.dbb and rollouts.baseline is not None:
            raise RuntimeError("algorithm.advantages=dbb: another callback (V0.5's ValuePrior) already set the "
                               "baseline; use one of the two")
        wins, losses = F.group_outcomes(rollouts.rewards.detach().float().cpu(), rollouts.group.cpu(),
                                        rollouts.num_groups, low=self.low, high=self.high)  # [B] each
        texts = list(dict.fromkeys(rollouts.prompts))  # a prompt twice in the batch is one history
        where = {t: i for i, t in enumerate(texts)}
        index = torch.tensor([where[p] for p in rollouts.prompts], dtype=torch.long)  # [B] → [U]
        u = len(texts)
        s = torch.zeros(u, dtype=torch.float64).index_add_(0, index, wins.double())  # [U]
        f = torch.zeros(u, dtype=torch.float64).index_add_(0, index, losses.double())  # [U]
        old = torch.tensor([self.record(t) for t in texts], dtype=torch.float64).view(u, 3)  # [U, 3]
        opts = self.options
        alpha, beta = F.discounted_beta_update(old[:, 0], old[:, 1], s, f, discount=opts.dbb_discount,
                                               prior_alpha=opts.dbb_prior_alpha, prior_beta=opts.dbb_prior_beta)
        solved_before = old[:, 2] > 0  # [U]
        self._pending = {t: [a, b, float(sb or w > 0)] for t, a, b, sb, w in
                         zip(texts, alpha.tolist(), beta.tolist(), solved_before.tolist(), s.tolist())}
        mean, _ = F.beta_mean_std(alpha, beta, low=self.low, high=self.high)  # [U]
        seen = sum(t in self.records for t in texts)
        self._metrics = {"history/seen_frac": seen / max(u, 1),
                         "history/solved_frac": float(solved_before.double().mean()) if u else 0.0}
        if self.dbb:
            rollouts.baseline = mean[index].float()  # [B]
            self._metrics["history/dbb_mean"] = float(mean.mean()) if u else 0.0
        if opts.boundary_gating:
            rollouts.update_groups = ~solved_before[index]  # [B] True = the prompt may still teach
            self._metrics["history/gated_frac"] = float(solved_before[index].double().mean()) if u else 0.0

    @override
    def on_rl_step_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", rollouts: Rollouts) -> None:
        pending, self._pending = self._pending or {}, None
        for part in (D.all_gather_object(pending) if D.world_size() > 1 else [pending]):  # every rank's, rank order
            self.records.update(part)
        pl_module.log_metrics({k: torch.tensor(v) for k, v in self._metrics.items()})
        self._metrics = {}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"records": {p: list(r) for p, r in self.records.items()}, "options": vars(self.options).copy()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = {p: [float(v) for v in r] for p, r in state_dict["records"].items()}
