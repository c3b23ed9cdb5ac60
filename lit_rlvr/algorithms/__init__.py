"""What a variant adds beyond a loss and an advantage (those are chosen by name from `lit_rlvr.functional`):
collectors that decide which rollouts a step trains on (DAPO's dynamic sampling: `filter_groups`)."""

from lit_rlvr.algorithms.filter_groups import FilterGroups, GenerationBudgetError, GroupFilter

__all__ = ["FilterGroups", "GenerationBudgetError", "GroupFilter"]
