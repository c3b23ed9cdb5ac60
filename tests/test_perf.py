"""`lit_rlvr.run.perf`: the peak FLOP/s the MFU divides by (measured once per CPU model, thread count and dtype and
cached; published per GPU and dtype; overridable), the model shape read from a config, and the per-step
bookkeeping of `StepFlops` (prefills per distinct prompt and weight source)."""

import json
import logging

import pytest
import torch

from lit_rlvr.functional.flops import SHAPE_KEYS
from lit_rlvr.models.tiny import tiny_config
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.run import perf


@pytest.fixture
def measurements(monkeypatch):
    calls = []

    def fake(dtype, **_):
        calls.append((dtype, torch.get_num_threads()))
        return 1.0e11 * len(calls)

    monkeypatch.setattr(perf, "measure_matmul_peak", fake)
    return calls


def test_cpu_peak_is_measured_once_and_cached(tmp_path, measurements):
    first = perf.cpu_peak(torch.float32, cache_dir=tmp_path, threads=1)
    again = perf.cpu_peak(torch.float32, cache_dir=tmp_path, threads=1)
    assert first == again == 1.0e11 and measurements == [(torch.float32, 1)]  # measured at the asked threads
    assert perf.cpu_peak(torch.float32, cache_dir=tmp_path, threads=2) == 2.0e11  # another key: measured again
    assert perf.cpu_peak(torch.bfloat16, cache_dir=tmp_path, threads=1) == 3.0e11
    files = sorted(p.name for p in (tmp_path / "peak_flops").iterdir())
    assert len(files) == 3 and all(name.endswith(".json") for name in files)  # no temporary file left behind
    record = json.loads((tmp_path / "peak_flops" / files[0]).read_text())
    assert record["cpu"] == perf.cpu_name() and record["flops_per_s"] > 0


def test_a_corrupt_cache_entry_is_measured_again(tmp_path, measurements, caplog):
    perf.cpu_peak(torch.float32, cache_dir=tmp_path, threads=1)
    (path,) = (tmp_path / "peak_flops").iterdir()
    path.write_text('{"cpu": "trunc')
    with caplog.at_level(logging.WARNING, logger="lit_rlvr.run.perf"):
        assert perf.cpu_peak(torch.float32, cache_dir=tmp_path, threads=1) == 2.0e11
    assert str(path) in caplog.text
    assert json.loads(path.read_text())["flops_per_s"] == 2.0e11


def test_the_measurement_leaves_the_run_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    peak = perf.measure_matmul_peak(torch.float32, size=64, repeats=2)
    assert peak > 0 and torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
    ("NVIDIA H200", torch.bfloat16, 989.4e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
    ("NVIDIA A10", torch.bfloat16, 125e12),
    ("NVIDIA L40S", torch.float16, 362.05e12),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2e12),
    ("NVIDIA A10G", torch.bfloat16, None),  # not in the table (and not the A10's figure)
    ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 tensor cores
])
def test_published_peaks(name, dtype, peak):
    got = perf.published_peak(name, dtype)
    assert got is None if peak is None else got == pytest.approx(peak)


def test_fp32_matmuls_reach_the_tf32_peak_only_when_torch_allows_tf32():
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert perf.published_peak("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(67e12)
        torch.set_float32_matmul_precision("high")
        assert perf.published_peak("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(494.7e12)
    finally:
        torch.set_float32_matmul_precision(saved)


def test_compute_dtype_follows_lightning_precision():
    assert perf.compute_dtype("bf16-mixed", torch.float32) == torch.bfloat16
    assert perf.compute_dtype("16-mixed", torch.float32) == torch.float16
    assert perf.compute_dtype("32-true", torch.float32) == torch.float32
    assert perf.compute_dtype("bf16-true", torch.bfloat16) == torch.bfloat16
    assert perf.compute_dtype("32-true", torch.float32, torch.bfloat16) == torch.bfloat16  # FSDP2's param_dtype


@pytest.mark.parametrize("bad", [0, -1.0, "fast", True])
def test_a_bad_override_names_the_key(bad):
    with pytest.raises(ValueError, match=r"^perf\.peak_flops=.* is not valid: expected the device's peak FLOP/s"):
        perf.StepFlops(peak_flops=bad)


def test_train_py_refuses_a_bad_peak_before_any_work():
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.config_check import check_config
    from lit_rlvr.config.errors import ConfigError

    conf = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("config", overrides=["perf.peak_flops=-5"])
    with pytest.raises(ConfigError, match=r"^perf\.peak_flops=-5(\.0)? is not valid"):
        check_config(cfg)


def test_shape_of_a_config():
    shape = perf.transformer_shape(tiny_config(101, hidden_size=256, layers=4, heads=4))
    assert shape == dict(layers=4, hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64, vocab=101)
    assert set(shape) == set(SHAPE_KEYS)
    moe = tiny_config(101)
    moe.num_experts = 8
    assert perf.transformer_shape(moe) is None


def _rollouts(prompt_lengths, response_lengths, group, source):
    width = max(prompt_lengths)
    prompt_mask = torch.arange(width - 1, -1, -1) < torch.tensor(prompt_lengths)[:, None]
    response_mask = torch.arange(max(response_lengths)) < torch.tensor(response_lengths)[:, None]
    zeros = torch.zeros_like(response_mask, dtype=torch.long)
    return Rollouts(prompt_ids=torch.zeros_like(prompt_mask, dtype=torch.long), prompt_mask=prompt_mask,
                    response_ids=zeros, response_mask=response_mask, old_logp=zeros.float(),
                    group=torch.tensor(group), source=torch.tensor(source), num_groups=max(group) + 1,
                    prompts=[""] * (max(group) + 1), answers=[0] * (max(group) + 1))


def test_step_flops_counts_a_prefill_per_prompt_and_weight_source():
    """2 prompts × 2 weight sources × 2 samples: 4 prefills; the metrics are the functional counts over the
    phases' seconds, and the MFU that over the peak."""
    meter = perf.StepFlops(peak_flops=1e9)
    meter.shape = perf.transformer_shape(tiny_config(101))
    meter.peak = 1e9
    rollouts = _rollouts([3, 3, 3, 3, 5, 5, 5, 5], [4, 2, 6, 1, 3, 3, 2, 7], [0, 0, 0, 0, 1, 1, 1, 1],
                         [0, 0, 1, 1, 0, 0, 1, 1])
    meter.reset()
    meter.add_generation(rollouts)
    prefill, prompt, response, _ = meter._generated[0]
    assert sorted(prefill.tolist()) == [3, 3, 5, 5]
    metrics = meter.metrics(rollouts, {"gen_s": 2.0, "train_s": 4.0}, passes=1, reference=False, recompute=False)
    from lit_rlvr import functional as F

    gen, _ = F.generation_flops(prefill, prompt, response, **meter.shape)
    update, _ = F.update_flops(prompt, response, **meter.shape)
    assert metrics["perf/flops_per_s_gen"] == pytest.approx(float(gen) / 2.0, rel=1e-6)
    assert metrics["perf/flops_per_s_update"] == pytest.approx(float(update) / 4.0, rel=1e-6)
    assert metrics["perf/mfu_update"] == pytest.approx(float(update) / 4.0 / 1e9, rel=1e-6)


def test_activation_checkpointing_is_read_without_a_deprecation_warning(recwarn):
    from lit_rlvr.models.tiny import build_tiny

    model, _ = build_tiny()
    assert not perf.recomputes_forward(model)
    model.gradient_checkpointing_enable()
    recwarn.clear()
    assert perf.recomputes_forward(model)
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]  # read every step: no warning


def test_step_flops_counts_the_adapters_where_they_run():
    """A LoRA policy: the update counts its adapters (and the frozen base's cheaper backward); generation counts
    them on an engine that runs them (the trainer's modules, or one serving LoRA), not on a merged copy."""
    from types import SimpleNamespace

    from lit_rlvr import functional as F
    from lit_rlvr.config.settings import LoraOptions
    from lit_rlvr.models.lora import apply_lora
    from lit_rlvr.models.tiny import build_tiny

    policy = apply_lora(build_tiny(seed=0)[0], LoraOptions(rank=2))
    adapter = sum(p.numel() for n, p in policy.named_parameters() if ".lora_" in n)
    trainer = SimpleNamespace(precision="32-true", strategy=None)
    rollouts = _rollouts([3, 3], [4, 2], [0, 0], [0, 0])
    seen = {}
    for name, shares, serves in (("shared", True, False), ("served", False, True), ("merged", False, False)):
        meter = perf.StepFlops(peak_flops=1e9)
        meter.setup(policy, torch.device("cpu"), trainer,
                    SimpleNamespace(shares_weights=shares, serves_lora=serves, generation_dtype=lambda: None))
        meter.reset()
        meter.add_generation(rollouts)
        seen[name] = meter.metrics(rollouts, {"gen_s": 1.0, "train_s": 1.0}, passes=1, reference=False,
                                   recompute=False)
    assert meter.adapter == adapter > 0
    prefill, prompt, response, _ = meter._generated[0]
    update, _ = F.update_flops(prompt, response, adapter=adapter, **meter.shape)
    for name, gen_adapter in (("shared", adapter), ("served", adapter), ("merged", 0)):
        gen, _ = F.generation_flops(prefill, prompt, response, adapter=gen_adapter, **meter.shape)
        assert float(seen[name]["perf/flops_per_s_gen"]) == pytest.approx(float(gen), rel=1e-6)
        assert float(seen[name]["perf/flops_per_s_update"]) == pytest.approx(float(update), rel=1e-6)
    assert seen["shared"]["perf/flops_per_s_gen"] > seen["merged"]["perf/flops_per_s_gen"]
