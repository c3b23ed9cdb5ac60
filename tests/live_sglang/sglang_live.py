"""Helpers of the live SGLang tests (marked live_sglang): where sglang imports, the CPU engine options, and
process clean-up. They run in the venv that scripts/sglang_cpu_env.sh builds; elsewhere they are skipped."""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # before sglang is imported: its CPU platform

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = REPO / "conf" / "engine" / "sglang_cpu.yaml"


def _why_not() -> str | None:
    try:
        importlib.import_module("sglang.srt.entrypoints.engine")
    except Exception as err:  # ImportError, or a CUDA-only dependency failing to load
        return (f"sglang does not import here ({type(err).__name__}: {str(err)[:120]}); build the live venv: "
                "bash scripts/sglang_cpu_env.sh VENV && VENV/bin/python -m pytest -m live_sglang")
    return None


SKIP_REASON = _why_not()
live = [pytest.mark.live_sglang, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]


def cpu_options(**overrides) -> dict:
    """`engine.options` of conf/engine/sglang_cpu.yaml (one set of CPU arguments for tests and runs)."""
    from omegaconf import OmegaConf

    from lit_rlvr.rollout.lora import SyncCheck

    options = OmegaConf.to_container(OmegaConf.load(CPU_CONFIG).options)
    SyncCheck.take_from(options)  # the rollout driver's post-push check, not an engine argument
    server_args = {**options.pop("server_args"), **overrides.pop("server_args", {})}
    return {**options, **overrides, "server_args": server_args}


def own_children(train_runs=None) -> list:
    """This process's children (psutil.Process), less the background train.py runs of `train_runs` (train_runs.py)
    and their descendants: each run has a session of its own, which its engines inherit; torchrun's workers start
    sessions of their own, but descend from the run."""
    import psutil

    if train_runs is None:
        return psutil.Process().children(recursive=True)
    with train_runs.starting:  # no run starts between the looks
        children = psutil.Process().children(recursive=True)
        spared = set()
        for proc in train_runs.procs:  # after listing the children: any of theirs is listed here too
            with contextlib.suppress(psutil.NoSuchProcess):
                spared |= {proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))}
        sessions = {proc.pid for proc in train_runs.procs}
        own = []
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                if child.pid not in spared and os.getsid(child.pid) not in sessions:
                    own.append(child)
        return own


def kill_children(train_runs=None) -> list[int]:
    """Kill what is left of this process's children (an engine a failed test did not shut down), except the
    background runs of `train_runs`, which end by themselves."""
    import psutil

    children = own_children(train_runs)
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=10)
    return [c.pid for c in children]
