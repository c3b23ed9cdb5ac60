"""Shared fixtures: one warm-started tiny model per test session, cached under the repo's .cache/."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("LIT_RLVR_CACHE", str(REPO / ".cache" / "lit_rlvr"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
import lit_rlvr  # noqa: E402,F401  (before torch loads: it sets the OpenMP wait settings)


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from lit_rlvr.models.warmup import resolve_model_path
    from tiny_options import TINY

    return resolve_model_path("tiny", TINY)  # = conf/model/tiny.yaml: the e2e run reuses it


@pytest.fixture
def gloo_world_of_one():
    """A one-rank gloo process group in this process (DTensor and collective code paths on a CPU)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
