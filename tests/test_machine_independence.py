"""The default's starting point and its RL gain do not depend on the CPU's float order.

A different CPU make sums in a different order (other kernels: AVX2 instead of AVX-512, another MKL code path).
Two warm-ups: the session's own (tests/conftest.py `tiny_path`: torch's default threads, this CPU's kernels, trained
once for every test that asks for the tiny model), and one in a cold cache of its own, warmed up by the run itself
with 1 thread and the next kernels down (`ATEN_CPU_CAPABILITY`, `MKL_ENABLE_INSTRUCTIONS`: AVX2 on an AVX-512 CPU).
The thread count alone does not change this model's float order on an Intel Xeon (1 and 2 threads gave
bit-identical weights); the kernels do, so the two warm-ups land on different weights (checked where there are
lower kernels) — as on two CPU makes. For both, the warm-up must stop in the target band and a short default RL
run (a `train.py` process each) must raise held-out accuracy.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tiny_options import BAND, ONE_THREAD, TINY

REPO = Path(__file__).resolve().parents[1]
RL_STEPS = 60


# the next kernels down from this CPU's best (vectorised: not much slower), as a CPU without them would run
LOWER_KERNELS = {"AVX512": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                 "AVX2": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}
LOWER = LOWER_KERNELS.get(torch.backends.cpu.get_cpu_capability(), {})


def _run(run_dir: Path, model_dir: Path, env: dict[str, str]) -> tuple[dict, dict]:
    """A default `train.py` run of RL_STEPS steps with `env` added, warm-started from `model_dir` (its cache
    entry; the run warms it up first when it is absent): (the warm-up's record, the run's summary)."""
    env = {**os.environ, "LIT_RLVR_CACHE": str(model_dir.parent), **env}
    cmd = [sys.executable, "train.py", f"trainer.max_steps={RL_STEPS}", "callbacks.progress=null",
           f"checkpoint_every={RL_STEPS}", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    if not model_dir.exists():  # other kernels, another cache key (the kernel family is in it): the cache's entry
        (model_dir,) = {p.parent for p in model_dir.parent.glob("tiny-*/warmup.json")}
    record = json.loads((model_dir / "warmup.json").read_text())
    record["weights"] = (model_dir / "model.safetensors").read_bytes()
    return record, json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tiny_path, tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """`shared`: from the session's warm-up, this CPU's kernels; `lower`: the lower kernels, a cold cache of its
    own (the same settings; the kernel family in the cache key names its entry). Side by side with 1 thread each,
    on CI's 2 cores (2 threads each made the shared run's 60 steps 2.5x slower: its threads waited on each other)."""
    base, shared = tmp_path_factory.mktemp("float_orders"), Path(tiny_path)
    plans = {"shared": (shared, ONE_THREAD), "lower": (base / "cache" / shared.name, {**ONE_THREAD, **LOWER})}
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = {name: pool.submit(_run, base / name, model_dir, env) for name, (model_dir, env) in plans.items()}
    return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
def test_warm_up_stops_in_the_target_band_with_two_float_orders(runs):
    assert runs["lower"][0]["threads"] == 1  # warmed up by its own run, as set
    for name, (record, summary) in runs.items():
        assert record["reached"] and record["accuracy"] >= TINY["target"], (name, record)
        assert BAND[0] <= summary["accuracy_before"] <= BAND[1], (name, summary["accuracy_before"], BAND)
    if LOWER:  # lower kernels exist (x86 with AVX2 or better)
        assert runs["shared"][0]["weights"] != runs["lower"][0]["weights"]  # two float orders, both in the band
        assert runs["shared"][0]["kernels"] != runs["lower"][0]["kernels"]  # each its own cache entry


@pytest.mark.slow
def test_short_rl_run_raises_held_out_accuracy_with_two_float_orders(runs):
    for name, (_, summary) in runs.items():
        assert summary["accuracy_after"] > summary["accuracy_before"], (name, summary)
