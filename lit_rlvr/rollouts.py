"""Moved to `lit_rlvr.rollout.batch` (issue 22); this name stays for code written against it."""

from lit_rlvr.rollout.batch import (BudgetRule, RolloutPlan, Rollouts, WeightContext, WeightStacks,
                                    rollouts_from_completions)

__all__ = ["BudgetRule", "RolloutPlan", "Rollouts", "WeightContext", "WeightStacks", "rollouts_from_completions"]
