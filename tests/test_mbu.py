"""Generation's memory-bandwidth utilisation (`perf/mbu_gen`, docs/mfu.md): the bytes decode must read
(`functional.flops.generation_bytes`) checked against a count by hand from the tiny model's own parameters and
config, the bandwidth it divides by (measured once per CPU and cached, published per GPU, overridable), and the
column in a short `train.py` run's metrics.csv."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_options import ONE_THREAD

from lit_rlvr.functional.flops import generation_bytes
from lit_rlvr.models.tiny import build_tiny
from lit_rlvr.run import perf

REPO = Path(__file__).resolve().parents[1]

# a made-up batch: 2 prompts (3 and 5 tokens) × 2 completions, one prefill per prompt
PROMPTS, RESPONSES, PREFILLS = [3, 3, 5, 5], [4, 2, 6, 1], [3, 5]


def by_hand(model, sources, dtype_bytes):
    """The bytes of the made-up batch, counted step by step from the model itself."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes
    weights = sum(p.numel() for p in model.parameters()) * dtype_bytes
    total = 0
    for source in sorted(set(sources)):
        rows = [i for i, s in enumerate(sources) if s == source]
        total += weights  # the prefill's forward
        for step in range(1, max(RESPONSES[i] for i in rows)):  # the batch decodes until its longest row ends
            total += weights
            total += sum(per_position * (PROMPTS[i] + step) for i in rows if step < RESPONSES[i])
    return total + per_position * sum(PREFILLS)  # the prefills' KV written


@pytest.mark.parametrize("sources", [[0, 0, 0, 0], [0, 0, 1, 1]])
def test_generation_bytes_match_a_count_by_hand(sources):
    model, _ = build_tiny(seed=0)
    shape = perf.transformer_shape(model.config)
    got, parts = generation_bytes(torch.tensor(PREFILLS), torch.tensor(PROMPTS), torch.tensor(RESPONSES),
                                  torch.tensor(sources), parameters=sum(p.numel() for p in model.parameters()),
                                  dtype_bytes=4, layers=shape["layers"], kv_heads=shape["kv_heads"],
                                  head_dim=shape["head_dim"])
    assert float(got) == by_hand(model, sources, 4)
    assert float(got) == float(sum(parts.values()))


def test_step_flops_logs_the_mbu_in_the_engines_dtype(tmp_path):
    """perf/mbu_gen = the batch's bytes (parameters in the engine's dtype: bf16 here) / gen_s / the bandwidth."""
    from test_perf import _rollouts

    model, _ = build_tiny(seed=0)
    meter = perf.StepFlops(peak_flops=1e12, cache_dir=str(tmp_path), peak_bandwidth=4e9)
    engine = SimpleNamespace(shares_weights=False, serves_lora=False, generation_dtype=lambda: torch.bfloat16)
    meter.setup(model, torch.device("cpu"), SimpleNamespace(precision="32-true", strategy=None), engine)
    meter.reset()
    rollouts = _rollouts(PROMPTS, RESPONSES, [0, 0, 1, 1], [0, 0, 0, 0])
    meter.add_generation(rollouts)
    metrics = meter.metrics(rollouts, {"gen_s": 2.0, "train_s": 1.0}, passes=1, reference=False, recompute=False)
    expected = by_hand(model, [0, 0, 0, 0], 2)
    assert float(metrics["perf/bytes_per_s_gen"]) == pytest.approx(expected / 2.0, rel=1e-6)
    assert float(metrics["perf/mbu_gen"]) == pytest.approx(expected / 2.0 / 4e9, rel=1e-6)
    assert not (tmp_path / "peak_bandwidth").exists()  # the override: nothing measured


def test_cpu_bandwidth_is_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake():
        calls.append(torch.get_num_threads())
        return 1.0e10 * len(calls)

    monkeypatch.setattr(perf, "measure_copy_bandwidth", fake)
    assert perf.cpu_bandwidth(cache_dir=tmp_path, threads=1) == perf.cpu_bandwidth(cache_dir=tmp_path, threads=1)
    assert calls == [1]  # measured at the asked threads, then read back
    assert perf.cpu_bandwidth(cache_dir=tmp_path, threads=2) == 2.0e10  # another key: measured again
    files = sorted((tmp_path / "peak_bandwidth").iterdir())
    assert len(files) == 2 and all(f.suffix == ".json" for f in files)  # no temporary file left behind
    record = json.loads(files[0].read_text())
    assert record["cpu"] == perf.cpu_name() and record["bytes_per_s"] > 0
    files[0].write_text('{"cpu": "trunc')  # an unreadable entry is measured again
    assert perf.cpu_bandwidth(cache_dir=tmp_path, threads=1) == 3.0e10


def test_the_copy_benchmark_measures_a_positive_rate():
    assert 0 < perf.measure_copy_bandwidth(mib=8, repeats=2) < math.inf


@pytest.mark.parametrize("name, bandwidth", [
    ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H200", 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 2.039e12),
    ("NVIDIA A100 80GB PCIe", 1.935e12),
    ("NVIDIA A100-SXM4-40GB", 1.555e12),
    ("NVIDIA L40S", 0.864e12),
    ("NVIDIA GeForce RTX 4090", 1.008e12),
    ("NVIDIA A10G", None),  # not in the table (and not the A10's figure)
])
def test_published_bandwidths(name, bandwidth):
    got = perf.published_bandwidth(name)
    assert got is None if bandwidth is None else got == pytest.approx(bandwidth)


@pytest.mark.parametrize("bad", [0, -1.0, "fast", True, float("inf")])
def test_a_bad_bandwidth_override_names_the_key(bad):
    with pytest.raises(ValueError, match=r"^perf\.peak_bandwidth=.* is not"):
        perf.StepFlops(peak_bandwidth=bad)


def test_train_py_refuses_a_bad_bandwidth_before_any_work():
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.config_check import check_config
    from lit_rlvr.config.errors import ConfigError

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["perf.peak_bandwidth=-5"])
    with pytest.raises(ConfigError, match=r"^perf\.peak_bandwidth=-5(\.0)? is not valid"):
        check_config(cfg)


def test_a_short_run_logs_the_mbu_every_step(tiny_path, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "trainer.max_steps=2", "data.batch_size=4",
           "algorithm.group_size=4", "data.num_test=4", "eval_before=false", "callbacks.progress=null",
           "checkpoint_every=100"]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with (run_dir / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("reward/mean")]
    assert len(rows) == 2
    for name in ("perf/mbu_gen", "perf/bytes_per_s_gen"):  # against this CPU's measured copy bandwidth
        assert all(0 < float(r[name]) < math.inf for r in rows), name
