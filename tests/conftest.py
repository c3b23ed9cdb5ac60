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
    from lit_rlvr.rollout.warmup import resolve_model_path
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


# The slowest files (measured, serial, AMD EPYC 2 cores) are collected first: the README's `pytest -n 2 --dist
# loadfile` hands whole files to its two workers in collection order, so a slow file collected last would run
# alone at the end while the other worker idles. Within a file the order is unchanged.
SLOW_FILES = ("test_fsdp.py", "test_storage.py", "test_default_run.py", "test_cli.py", "test_faults.py",
              "test_lora_checkpoints.py", "test_resume.py", "test_resume_checks.py", "test_machine_independence.py",
              "test_hostile_settings.py", "test_compile_update.py", "test_reward_faults.py", "test_bench_baton.py",
              "test_hostile_envs.py", "test_warmup_cache.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort
