"""The default's starting point and its RL gain do not depend on the CPU's float order.

A different CPU make sums in a different order (other kernels: AVX2 instead of AVX-512, another MKL code path).
Two runs in separate processes, each with its own cache: 1 thread with this CPU's kernels, and 2 threads with
the next kernels down (`ATEN_CPU_CAPABILITY`, `MKL_ENABLE_INSTRUCTIONS`: AVX2 on an AVX-512 CPU). The thread
count alone does not change this model's float order on an Intel Xeon (1 and 2 threads gave bit-identical
weights); the kernels do, so the two runs land on different weights (checked where there are lower kernels)
— as on two CPU makes. In both, the
warm-up must stop in the target band and a short default RL run must raise held-out accuracy.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_options import BAND, TINY

REPO = Path(__file__).resolve().parents[1]
RL_STEPS = 60


# the next kernels down from this CPU's best (vectorised: not much slower), as a CPU without them would run
LOWER_KERNELS = {"AVX512": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                 "AVX2": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}
VARIANTS = {1: {}, 2: LOWER_KERNELS.get(torch.backends.cpu.get_cpu_capability(), {})}  # threads -> kernels


def _run(threads: int, base: Path) -> tuple[dict, dict]:
    """A default `train.py` run of RL_STEPS steps with `threads` threads, its kernels and a cold cache of its
    own: (the warm-up's record, the run's summary)."""
    cache, run_dir = base / f"cache{threads}", base / f"run{threads}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "LIT_RLVR_CACHE": str(cache), **VARIANTS[threads]}
    cmd = [sys.executable, "train.py", f"trainer.max_steps={RL_STEPS}", "callbacks.progress=null",
           f"checkpoint_every={RL_STEPS}", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (model_dir,) = cache.glob("tiny-*/")
    record = json.loads((model_dir / "warmup.json").read_text())
    record["weights"] = (model_dir / "model.safetensors").read_bytes()
    return record, json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[dict, dict]]:
    base = tmp_path_factory.mktemp("threads")
    return {threads: _run(threads, base) for threads in VARIANTS}


@pytest.mark.slow
def test_warm_up_stops_in_the_target_band_with_two_float_orders(runs):
    for threads, (record, summary) in runs.items():
        assert record["threads"] == threads
        assert record["reached"] and record["accuracy"] >= TINY["target"], (threads, record)
        assert BAND[0] <= summary["accuracy_before"] <= BAND[1], (threads, summary["accuracy_before"], BAND)
    if VARIANTS[2]:  # lower kernels exist (x86 with AVX2 or better)
        assert runs[1][0]["weights"] != runs[2][0]["weights"]  # two float orders, yet both stop in the band


@pytest.mark.slow
def test_short_rl_run_raises_held_out_accuracy_with_two_float_orders(runs):
    for threads, (_, summary) in runs.items():
        assert summary["accuracy_after"] > summary["accuracy_before"], (threads, summary)
