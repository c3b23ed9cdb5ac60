"""`bench/weight_sync.py --engine sglang`: weight pushes into a live `sglang.Engine` on this CPU.

    SGLANG_USE_CPU_ENGINE=1 VENV/bin/python bench/weight_sync.py --engine sglang [--json] [--repeats 20] [--mb 100] \
        [--steps 6]

VENV is the environment of scripts/sglang_cpu_env.sh. Two figures:
- `push_bytes_per_s`: `push_weights` of the synthetic Qwen3 (`--mb` MB, fp32, 256 MiB buckets) into an
  `SGLangEngine` (conf/engine/sglang_cpu.yaml) against a memcpy of the same bytes, alternated repeat by repeat;
  each push is one sglang weight-update session (tensors serialized to the scheduler process, then loaded).
- `sync_share_sglang` / `sync_share_hf`: median(time/sync_s) / median(time/step_s) over the steps of a short
  `python train.py` GRPO run with `engine=sglang_cpu` and with `engine=hf` (the default, `shared` mode: no copy),
  read from each run's metrics.csv; the first step is dropped (warm-up).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

REPO = Path(__file__).resolve().parents[1]
BUCKET_MB = 256


def push_bandwidth(mb: float, repeats: int) -> dict[str, float]:
    import torch
    from omegaconf import OmegaConf

    from lit_rlvr.models import load_policy
    from lit_rlvr.rollout.lora import SyncCheck
    from lit_rlvr.rollout.sglang import SGLangEngine
    from lit_rlvr.rollout.weights import push_weights
    from weight_sync import synthetic_model

    options = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "engine" / "sglang_cpu.yaml").options)
    SyncCheck.take_from(options)  # the rollout driver's post-push check, not an engine argument
    model = synthetic_model(mb)
    _, tokenizer = load_policy(common.model_path(common.compose("grpo")), "float32")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    src = torch.empty(nbytes // 4).normal_()
    dst = torch.empty_like(src)
    engine = SGLangEngine(model, tokenizer, **{**options, "base_port": 32000})
    try:
        def push():
            push_weights(engine, model, bucket_bytes=BUCKET_MB << 20)  # ends the sglang update session too

        push()  # warm-up
        pushes, copies = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            push()
            pushes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
    finally:
        engine.shutdown()
    push_bps, memcpy_bps = nbytes / common.median(pushes), nbytes / common.median(copies)
    return {"push_bytes_per_s": push_bps, "memcpy_bytes_per_s": memcpy_bps, "ratio": push_bps / memcpy_bps,
            "model_bytes": nbytes, "bucket_mb": BUCKET_MB, "repeats": repeats}


def sync_share(engine: str, steps: int) -> float:
    """median(sync_s) / median(step_s) of a `steps`-step GRPO run with `engine`, first step dropped."""
    with tempfile.TemporaryDirectory(prefix="lit_rlvr_sync_") as run_dir:
        cmd = [sys.executable, "train.py", f"engine={engine}", f"trainer.max_steps={steps}", "eval_before=false",
               "data.num_test=4", "callbacks.progress=null", f"hydra.run.dir={run_dir}"]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        with (Path(run_dir) / "metrics.csv").open() as handle:
            rows = [r for r in csv.DictReader(handle) if r.get("time/step_s")][1:]
    return common.median(float(r["time/sync_s"]) for r in rows) / common.median(float(r["time/step_s"]) for r in rows)


def run(args) -> dict:
    result = push_bandwidth(args.mb, args.repeats)
    result.update(sync_share_sglang=sync_share("sglang_cpu", args.steps), sync_share_hf=sync_share("hf", args.steps),
                  steps=args.steps, engine="sglang", **common.context())
    return result
