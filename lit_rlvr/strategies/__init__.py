"""Distributed training strategies: `FSDPRolloutStrategy` (FSDP2 with one colocated rollout engine per rank)."""

from lit_rlvr.strategies.fsdp import FSDPRolloutStrategy

__all__ = ["FSDPRolloutStrategy"]
