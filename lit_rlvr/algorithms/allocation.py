"""The rivals of V0.5's OSLA allocation, at a fixed mean of rollouts per prompt (`ValuePrior(allocation=...)`).

After the first round (k_init samples per prompt), one more round brings the batch to `mean_rollouts` samples per
prompt on average (round(mean_rollouts · B) in all, each prompt at most k_max):

    uniform  every prompt the same number (`functional.uniform_allocation`)
    beta     in proportion to √(p̂(1 − p̂)), p̂ the mean of the prompt's Beta posterior: Beta(1, 1), the prompt's
             successes and failures of earlier steps, and this step's first round (`functional.beta_allocation`;
             the spirit of VIP, arXiv 2602.01601, and MoPPS, arXiv 2507.04632: a Beta posterior of each prompt's
             success rate from its own history, and more samples where the predicted reward variance is larger)

OSLA's own count per prompt depends on the data; a study compares the rules at equal rollouts by setting
`mean_rollouts` to the mean OSLA spent (docs/results/rivals.md).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_rlvr import functional as F

ALLOCATIONS = ("osla", "uniform", "beta")


class FixedBudget:
    """One extra round at a fixed mean of rollouts per prompt, and the per-prompt Beta history `beta` reads.

    `snapshot(prompts)` (at plan time, in the trainer's thread) gives the history's (α, β) of the plan's prompts;
    `extra(...)` (the budget rule, maybe in the async producer) reads only that snapshot; `observe(...)` (at the
    step's end) adds a step's outcomes to the history."""

    def __init__(self, rule: str, mean_rollouts: float, *, k_max: int) -> None:
        self.rule, self.mean_rollouts, self.k_max = rule, mean_rollouts, k_max
        self.records: dict[str, list[float]] = {}  # prompt → [α, β] (Beta(1, 1) + its successes and failures)

    def snapshot(self, prompts: list[str]) -> list[tuple[float, float]]:
        return [tuple(self.records.get(p, (1.0, 1.0))) for p in prompts]

    def extra(self, counts: list[int], mean: list[float], prior: list[tuple[float, float]], *, low: float,
              high: float) -> Optional[list[int]]:
        """Extra samples per prompt [B] after the first round (None: none). `mean`: each prompt's mean reward so
        far [B], `counts` its samples [B], `prior` the snapshot's (α, β) [B]."""
        total = round(self.mean_rollouts * len(counts))
        if self.rule == "uniform":
            extra = F.uniform_allocation(counts, total, k_max=self.k_max)
        else:
            wins = [c * (m - low) / (high - low) for m, c in zip(mean, counts)]  # successes of ±1 rewards
            p_hat = [(a + w) / (a + b + c) for (a, b), w, c in zip(prior, wins, counts)]
            extra = F.beta_allocation(p_hat, counts, total, k_max=self.k_max)
        return extra if sum(extra) > 0 else None

    def observe(self, prompts: list[str], mean: list[float], counts: list[int], *, low: float, high: float) -> None:
        """Add one step's outcomes (each prompt's mean reward and count) to the history (γ = 1: all steps count)."""
        if self.rule != "beta":
            return
        wins = torch.tensor([c * (m - low) / (high - low) for m, c in zip(mean, counts)], dtype=torch.float64)
        n = torch.tensor(counts, dtype=torch.float64)
        old = torch.tensor(self.snapshot(prompts), dtype=torch.float64).view(len(prompts), 2)
        alpha, beta = F.discounted_beta_update(old[:, 0], old[:, 1], wins, n - wins, discount=1.0, prior_alpha=1.0,
                                               prior_beta=1.0)
        self.records.update({p: [a, b] for p, a, b in zip(prompts, alpha.tolist(), beta.tolist())})

    def state_dict(self) -> dict[str, Any]:
        return {"records": {p: list(r) for p, r in self.records.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = {p: [float(v) for v in r] for p, r in state.get("records", {}).items()}
