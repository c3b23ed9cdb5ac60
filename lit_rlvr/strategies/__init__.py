"""Distributed training strategies: `FSDP2Strategy` (FSDP2 sharding per decoder block, a rollout engine per rank)."""

from lit_rlvr.strategies.fsdp import FSDP2Strategy

__all__ = ["FSDP2Strategy"]
