"""Distributed training strategies: `FSDP2Strategy` (FSDP2 sharding per decoder block; `FSDPRolloutStrategy` is its
old name)."""

from lit_rlvr.strategies.fsdp import FSDP2Strategy, FSDPRolloutStrategy

__all__ = ["FSDP2Strategy", "FSDPRolloutStrategy"]
