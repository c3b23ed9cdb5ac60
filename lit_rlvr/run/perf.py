"""Model FLOPs utilisation (MFU) of each RL step: `perf/mfu_gen`, `perf/mfu_update`, and the generation's
memory-bandwidth utilisation (MBU), `perf/mbu_gen` (docs/mfu.md).

MFU = model FLOPs of a phase (`functional.flops`, from the model's config and the step's real token counts) /
the phase's seconds (`time/gen_s`, `time/train_s`) / the device's peak FLOP/s. The peak (one owner: the config key
`perf.peak_flops`; null picks it here): on a GPU the vendor's published dense peak for the compute dtype
(`PUBLISHED_PEAKS`), on a CPU a large matmul measured once and cached under the run's cache dir, keyed by CPU
model, thread count and dtype.

MBU = the bytes generation must read (`functional.flops.generation_bytes`: the weights once per forward of the
batch, the KV cache at every decode step) / `time/gen_s` / the device's memory bandwidth (one owner:
`perf.peak_bandwidth`; null picks it here): on a GPU the published figure (`PUBLISHED_BANDWIDTHS`), on a CPU a
large tensor copy measured once and cached like the FLOP peak, keyed by CPU model and thread count.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from lit_rlvr import functional as F
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import range_problems
from lit_rlvr.functional.flops import KV_SHAPE_KEYS, SHAPE_KEYS, generation_bytes
from lit_rlvr.run.cache_entry import cache_root, default_cache_dir

log = logging.getLogger(__name__)

KEY, BANDWIDTH_KEY = "perf.peak_flops", "perf.peak_bandwidth"
TERA = 1e12
# Dense (no structured sparsity) tensor-core peaks per device from the vendors' datasheets, FLOP/s; fp32 is the
# plain fp32 peak, tf32 what fp32 matmuls reach when torch allows TF32. The first pattern that matches the device
# name wins (word boundaries: "A10" is neither "A100" nor "A10G").
PUBLISHED_PEAKS: tuple[tuple[str, dict[str, float]], ...] = tuple(
    (pattern, {k: v * TERA for k, v in peaks.items()}) for pattern, peaks in (
        (r"\bH200 NVL\b", dict(fp32=60, tf32=417.5, bf16=835.5, fp16=835.5)),
        (r"\bH200\b", dict(fp32=67, tf32=494.7, bf16=989.4, fp16=989.4)),
        (r"\bH100 NVL\b", dict(fp32=60, tf32=417.5, bf16=835.5, fp16=835.5)),
        (r"\bH100 PCIe\b", dict(fp32=51, tf32=378, bf16=756, fp16=756)),
        (r"\bH100\b", dict(fp32=67, tf32=494.7, bf16=989.4, fp16=989.4)),  # SXM
        (r"\bA100\b", dict(fp32=19.5, tf32=156, bf16=312, fp16=312)),
        (r"\bL40S\b", dict(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05)),
        (r"\bL4\b", dict(fp32=30.3, tf32=60, bf16=121, fp16=121)),
        (r"\bA10\b", dict(fp32=31.2, tf32=62.5, bf16=125, fp16=125)),
        (r"\b4090\b", dict(fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2)),  # fp32 accumulation
        (r"\b3090\b", dict(fp32=35.6, tf32=35.6, bf16=71, fp16=71)),
        (r"\bV100\b", dict(fp32=15.7, tf32=15.7, fp16=125)),
        (r"\bT4\b", dict(fp32=8.1, tf32=8.1, fp16=65)),
        (r"\bMI300X\b", dict(fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4)),
    ))
# Memory bandwidth per device from the vendors' datasheets, bytes/s; the first pattern that matches wins.
PUBLISHED_BANDWIDTHS: tuple[tuple[str, float], ...] = tuple((pattern, tb_s * TERA) for pattern, tb_s in (
    (r"\bH200\b", 4.8),  # SXM and NVL
    (r"\bH100 NVL\b", 3.9),
    (r"\bH100 PCIe\b", 2.0),
    (r"\bH100\b", 3.35),  # SXM
    (r"\bA100\b(?=.*80GB)(?=.*PCI[Ee])", 1.935),
    (r"\bA100\b(?=.*80GB)", 2.039),  # SXM4
    (r"\bA100\b", 1.555),  # 40GB, SXM4 and PCIe
    (r"\bL40S\b", 0.864),
    (r"\bL4\b", 0.3),
    (r"\bA10\b", 0.6),
    (r"\b4090\b", 1.008),
    (r"\b3090\b", 0.936),
    (r"\bV100\b", 0.9),
    (r"\bT4\b", 0.32),
    (r"\bMI300X\b", 5.3),
))
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def transformer_shape(config: Any) -> Optional[dict[str, int]]:
    """The keywords of `functional.flops` from a transformers config (Llama, Qwen, Mistral and other dense
    decoders with a gated MLP), or None for one it cannot describe (mixture of experts, missing sizes)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None  # the active experts' FLOPs depend on the routing: not this formula
    try:
        heads = int(config.num_attention_heads)
        shape = dict(layers=int(config.num_hidden_layers), hidden=int(config.hidden_size),
                     intermediate=int(config.intermediate_size), heads=heads,
                     kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                     head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                     vocab=int(config.vocab_size))
    except (AttributeError, TypeError, ValueError):
        return None
    return shape


def recomputes_forward(model: torch.nn.Module) -> bool:
    """Whether the backward runs the decoder layers' forward again (activation checkpointing; transformers
    renamed the flag `is_activation_checkpointing`, the old name warns)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


def compute_dtype(precision: str, param_dtype: torch.dtype, strategy_dtype: Optional[torch.dtype] = None
                  ) -> torch.dtype:
    """The dtype the matmuls run in: a sharding strategy's compute dtype (FSDP2's `param_dtype`), else as
    Lightning's `precision` ("bf16-mixed", "32-true", …) has it, else the parameters'."""
    if strategy_dtype is not None:
        return strategy_dtype
    precision = str(precision)
    if "bf16" in precision:
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return param_dtype


def published_peak(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """The published dense peak FLOP/s of `device_name` for matmuls in `dtype` (fp32: TF32's when torch allows
    it), or None for a device or dtype the table lacks."""
    name = DTYPE_NAMES.get(dtype)
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        name = "tf32"
    peaks = first_match(PUBLISHED_PEAKS, device_name)
    return None if peaks is None else peaks.get(name)


def published_bandwidth(device_name: str) -> Optional[float]:
    """The published memory bandwidth of `device_name` in bytes/s, or None for a device the table lacks."""
    return first_match(PUBLISHED_BANDWIDTHS, device_name)


def first_match(table: tuple[tuple[str, Any], ...], device_name: str) -> Any:
    """The value of the first row of `table` whose pattern is found in `device_name`, else None."""
    return next((value for pattern, value in table if re.search(pattern, device_name)), None)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def measure_matmul_peak(dtype: torch.dtype = torch.float32, *, size: int = 2048, repeats: int = 8) -> float:
    """FLOP/s of torch's current threads on [size, size] matmuls: the best of `repeats`, each timed by the
    process's CPU time (FLOPs × threads / CPU seconds), not its wall time, so that other processes on a shared
    machine do not lower the peak (measured on a 2-core AMD EPYC at load average 16: 130-160 GFLOP/s by CPU time,
    6-25 by wall time; on a quiet machine the two agree). Its own generator: the run's random stream is not
    touched."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=out)  # first call: allocations, thread start-up
    best = 0.0
    for _ in range(repeats):
        t0 = time.process_time()
        torch.mm(a, b, out=out)
        best = max(best, 2.0 * size**3 * torch.get_num_threads() / max(time.process_time() - t0, 1e-9))
    return best


def measure_copy_bandwidth(*, mib: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth of torch's current threads in bytes/s: a `mib` MiB tensor copied into another (torch
    splits the copy over its threads), the best of `repeats`, counting the bytes read and written (2 × size, as
    STREAM's copy does; the write's cache line fills are not counted), timed by the process's CPU time over the
    threads like `measure_matmul_peak`: each thread's rate × threads, which other processes on a shared machine
    do not lower (on a 2-core AMD EPYC at load 5: 39-45 GB/s by CPU time, 17-22 by wall time, one thread alone
    19-25). It assumes the threads' rates add up, true for a few cores of a server CPU, whose memory bandwidth
    scales with cores far beyond 2."""
    source = torch.empty(mib << 18, dtype=torch.float32).fill_(1.0)  # 4-byte elements; filled: pages touched
    target = torch.empty_like(source).fill_(0.0)
    target.copy_(source)  # first call: thread start-up
    moved = 2.0 * source.numel() * source.element_size()
    best = 0.0
    for _ in range(repeats):
        t0 = time.process_time()
        target.copy_(source)
        best = max(best, moved * torch.get_num_threads() / max(time.process_time() - t0, 1e-9))
    return best


def cpu_peak(dtype: torch.dtype, *, cache_dir: str | Path, threads: Optional[int] = None) -> float:
    """The measured matmul peak (FLOP/s) of this CPU at `threads` threads (torch's by default), from the cache
    when this CPU model, thread count and dtype were measured before."""
    return cached_cpu_figure("peak_flops", f"-{DTYPE_NAMES.get(dtype, dtype)}", "flops_per_s",
                             lambda: measure_matmul_peak(dtype), cache_dir=cache_dir, threads=threads,
                             details={"dtype": str(dtype)})


def cpu_bandwidth(*, cache_dir: str | Path, threads: Optional[int] = None) -> float:
    """The measured copy bandwidth (bytes/s) of this CPU at `threads` threads (torch's by default), from the
    cache when this CPU model and thread count were measured before."""
    return cached_cpu_figure("peak_bandwidth", "", "bytes_per_s", measure_copy_bandwidth,
                             cache_dir=cache_dir, threads=threads)


def cached_cpu_figure(folder: str, suffix: str, field: str, measure: Callable[[], float], *, cache_dir: str | Path,
                      threads: Optional[int] = None, details: Optional[dict[str, Any]] = None) -> float:
    """A figure of this CPU that `measure` gives at `threads` threads, cached in
    `<cache_dir>/<folder>/<cpu model>-<threads>t<suffix>.json` under `field`: measured once per CPU model and
    thread count (and `suffix`). An unreadable entry is measured again and replaced."""
    threads = threads or torch.get_num_threads()
    cpu = cpu_name()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", cpu).strip("-")[:80]
    path = Path(cache_dir).expanduser() / folder / f"{slug}-{threads}t{suffix}.json"
    try:
        record = json.loads(path.read_text())
        if record.get("cpu") == cpu and record.get("threads") == threads and float(record[field]) > 0:
            return float(record[field])
        raise ValueError("the entry describes another machine")
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("%s: unreadable %s entry (%s); measuring again", path, folder, err)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        value = measure()
    finally:
        torch.set_num_threads(saved)
    record = {"cpu": cpu, "threads": threads, **(details or {}), field: value,
              "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
              "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:  # written aside, then renamed: a reader sees a whole entry or none
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError as err:  # an unwritable cache costs a measurement per run, nothing else
        log.warning("could not cache the %s in %s: %s", folder, path, err)
    log.info("measured %s %.4g %s (%s, %d threads%s)", folder, value, field, cpu, threads, suffix)
    return value


def device_peak(device: torch.device, dtype: torch.dtype, *, cache_dir: str | Path) -> Optional[float]:
    """The peak FLOP/s `perf.peak_flops=null` stands for on `device` (None: not known; the MFU is not logged)."""
    if device.type == "cpu":
        return cpu_peak(dtype, cache_dir=cache_dir)
    if device.type == "cuda":
        return published_peak(torch.cuda.get_device_name(device), dtype)
    return None


def device_bandwidth(device: torch.device, *, cache_dir: str | Path) -> Optional[float]:
    """The memory bandwidth (bytes/s) `perf.peak_bandwidth=null` stands for on `device` (None: not known; the MBU
    is not logged)."""
    if device.type == "cpu":
        return cpu_bandwidth(cache_dir=cache_dir)
    if device.type == "cuda":
        return published_bandwidth(torch.cuda.get_device_name(device))
    return None


class StepFlops:
    """The step's model FLOPs, MFU and MBU metrics, for `GRPOModule`: `setup` once, `reset` per step,
    `add_generation` for each generated batch (all of DAPO's refills too), `metrics` when the step is logged."""

    def __init__(self, peak_flops: Optional[float] = None, cache_dir: Optional[str] = None,
                 peak_bandwidth: Optional[float] = None):
        problems = range_problems({"peak_flops": peak_flops, "peak_bandwidth": peak_bandwidth},
                                  "perf")  # the rows train.py checks too
        ConfigError.check(problems)

        self.override, self.cache_dir = peak_flops, cache_root(cache_dir or default_cache_dir())
        self.bandwidth_override = peak_bandwidth
        self.shape: Optional[dict[str, int]] = None
        self.peak: Optional[float] = None
        self.bandwidth: Optional[float] = None  # bytes/s
        self.adapter = self.gen_adapter = 0  # LoRA's P (functional.flops) in the update and in generation
        self.gen_parameters = self.dtype_bytes = 0  # the weights generation reads, and its dtype's size
        self._generated: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []

    def setup(self, model: torch.nn.Module, device: torch.device, trainer: Any, engine: Any = None) -> None:
        """The model's shape and the peak for the trainer's device and compute dtype (one peak for both phases:
        generation runs in the training step, under the same precision); a LoRA policy's adapter size, which
        generation computes where the engine runs the adapters (the trainer's modules, or an engine serving LoRA)
        and not where it holds merged weights. The bytes generation reads: the model's parameters (the adapters
        where it runs them) in the engine's dtype, and the bandwidth of the trainer's device."""
        self.shape = transformer_shape(model.config)
        self.adapter = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
        unmerged = engine is not None and (engine.shares_weights or engine.serves_lora)
        self.gen_adapter = self.adapter if unmerged else 0
        self.gen_parameters = sum(p.numel() for p in model.parameters()) - self.adapter + self.gen_adapter
        gen_dtype = (engine.generation_dtype() if engine is not None else None) or next(model.parameters()).dtype
        self.dtype_bytes = torch.empty((), dtype=gen_dtype).element_size()
        if self.shape is None:
            log.warning("perf/*: the model's config (%s) is not a dense decoder this FLOP count describes; "
                        "no FLOP/s or MFU metrics", type(model.config).__name__)
            return
        dtype = compute_dtype(trainer.precision, next(model.parameters()).dtype,
                              getattr(trainer.strategy, "param_dtype", None))
        self.peak = self.override or device_peak(device, dtype, cache_dir=self.cache_dir)
        if self.peak is None:
            log.warning("perf/mfu_*: no published peak for this device and %s; set %s=FLOP/s to log the MFU",
                        dtype, KEY)
        self.bandwidth = self.bandwidth_override or device_bandwidth(device, cache_dir=self.cache_dir)
        if self.bandwidth is None:
            log.warning("perf/mbu_gen: no published memory bandwidth for this device; set %s=bytes/s to log the "
                        "MBU", BANDWIDTH_KEY)

    def reset(self) -> None:
        self._generated = []

    def add_generation(self, rollouts: Any) -> None:
        """Token counts of a generated batch: the prompts prefilled (one per distinct prompt and weight source),
        and each completion's prompt and response lengths and weight source."""
        prompt = rollouts.prompt_mask.sum(-1)  # [N]
        sources = int(rollouts.source.max()) + 1 if rollouts.num_samples else 1
        keys, inverse = torch.unique(rollouts.group * sources + rollouts.source, return_inverse=True)
        prefill = torch.zeros(len(keys), dtype=prompt.dtype).scatter(0, inverse, prompt)  # [U]
        self._generated.append((prefill, prompt, rollouts.response_mask.sum(-1), rollouts.source))

    def metrics(self, rollouts: Any, times: Mapping[str, float], *, passes: int, reference: bool,
                recompute: bool, old_forward: bool = False) -> dict[str, Tensor]:
        """perf/flops_per_s_gen, perf/flops_per_s_update, perf/bytes_per_s_gen and (with a peak) perf/mfu_gen,
        perf/mfu_update, (with a bandwidth) perf/mbu_gen."""
        if self.shape is None:
            return {}
        shape = {k: self.shape[k] for k in SHAPE_KEYS}
        gen = sum((F.generation_flops(*counts[:3], adapter=self.gen_adapter, **shape)[0]
                   for counts in self._generated), torch.tensor(0.0))
        kv_shape = {k: self.shape[k] for k in KV_SHAPE_KEYS}
        gen_bytes = sum((generation_bytes(*counts, parameters=self.gen_parameters, dtype_bytes=self.dtype_bytes,
                                          **kv_shape)[0] for counts in self._generated), torch.tensor(0.0))
        update, _ = F.update_flops(rollouts.prompt_mask.sum(-1), rollouts.response_mask.sum(-1), passes=passes,
                                   reference=reference, recompute=recompute, old_forward=old_forward,
                                   adapter=self.adapter, **shape)
        out = {}
        for name, flops, phase in (("gen", gen, "gen_s"), ("update", update, "train_s")):
            rate = flops / max(times.get(phase, 0.0), 1e-9)
            out[f"perf/flops_per_s_{name}"] = rate.float()
            if self.peak:
                out[f"perf/mfu_{name}"] = (rate / self.peak).float()
        byte_rate = gen_bytes / max(times.get("gen_s", 0.0), 1e-9)
        out["perf/bytes_per_s_gen"] = byte_rate.float()
        if self.bandwidth:
            out["perf/mbu_gen"] = (byte_rate / self.bandwidth).float()
        return out
