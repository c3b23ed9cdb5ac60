"""Other policy-gradient losses as short subclasses of `GRPOModule` (the worked examples of docs/architecture.md §4)."""

from lit_rlvr.algorithms.dapo import DAPOModule
from lit_rlvr.algorithms.dr_grpo import DrGRPOModule
from lit_rlvr.algorithms.gspo import GSPOModule

__all__ = ["DAPOModule", "DrGRPOModule", "GSPOModule"]
