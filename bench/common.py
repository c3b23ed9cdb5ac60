"""Shared pieces of the benchmarks (docs/architecture.md §9): the reference workload composed from conf/, a
Lightning trainer that only records per-step timings, and a baton that lets several trainers take turns in one process.

Every figure the benchmarks report is a ratio of runs measured side by side in one process: trainers run in
threads but never at once (the baton), so they see the same machine load, block by block.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import queue
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import lit_rlvr  # noqa: E402,F401  (first: it sets the OpenMP wait settings before torch loads; see bench/README.md)

import medium  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lit_rlvr.run.processes import peak_rss_mb  # noqa: E402,F401  (the benchmarks' peak RSS: common.peak_rss_mb)
from typing_extensions import override  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
THREADS = 2  # docs/architecture.md §9: 2 CPU cores

# the reference workload: 8 prompts × 8 completions, ≤ 24 new tokens, temperature 1.0, one update per step, fp32
REFERENCE = {"data.batch_size": 8, "algorithm.group_size": 8, "algorithm.max_new_tokens": 24,
             "algorithm.temperature": 1.0, "algorithm.ppo_epochs": 1, "algorithm.mini_batches": 1,
             "model.dtype": "float32"}
# the long workload (docs/architecture.md §9): the chain-of-thought task at levels of ~29 to ~188 completion
# tokens (addition to 4x2-digit multiplication), up to 224 new tokens (the model has 256 positions, which the prompt
# shares), and its own wider model (4 layers x 256,
# ~3.2M parameters), warmed up only until its answers are sometimes right (target 0.05: it writes the working at
# realistic lengths); the data config turns on token-budget micro-batches of 2048 tokens (bench/micro_batches.py)
LONG = {"data": "arithmetic_cot", "data.levels": "[1,3,5,7,8,9]", "algorithm.max_new_tokens": 224,
        "task_max_new_tokens": 256, "model.options.hidden_size": 256, "model.options.target": 0.05,
        "model.options.eval_problems": 64, "model.options.eval_samples": 2}
# medium: a model of real shape and token-id prompts built in code (bench/medium.py); its overrides name the built
# model folder and prompt file, so `parse_bench_args` fills them in
WORKLOADS = {"tiny": {}, "long": LONG, "medium": {}}  # overrides on top of REFERENCE
MFU_BUDGETS = {"mfu_gen": 0.35, "mfu_update": 0.50}  # the long workload's model FLOPs utilisation (docs/mfu.md)
# a ratio of two configurations compares equal work when their generated tokens and model FLOPs per step are each
# within 3 % of the other side's (bench/README.md "Equal work")
EQUAL_WORK_TOL = 0.03
METRICS = ("time/step_s", "time/gen_s", "time/reward_s", "time/train_s", "time/sync_s", "time/prior_s",
           "perf/tokens_per_s", "rollouts/per_step", "response/len_mean", "response/len_max", "micro/padding_frac",
           "v05/prior_present", "time/prior_setup_s", "time/prior_prefetch_s", "perf/mfu_gen", "perf/mfu_update",
           "perf/flops_per_s_gen", "perf/flops_per_s_update", "time/wait_s", "async/trainer_wait_frac",
           "async/engine_idle_frac", "async/staleness_mean", "async/partial_frac", "async/buffer_mb")


def quiet(threads: int = THREADS) -> None:
    """torch's thread count, and stdout kept for the results: Lightning's and transformers' info lines go away."""
    import torch

    if threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "trl", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass



def bench_parser(description: str, *, steps_help: str, warmup_help: str, block_help: str,
                 override_help: str) -> argparse.ArgumentParser:
    """The options every benchmark shares: --json, --steps, --warmup, --block, --threads, --override, --strict."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--steps", type=int, default=20, help=steps_help)
    parser.add_argument("--warmup", type=int, default=3, help=warmup_help)
    parser.add_argument("--block", type=int, default=1, help=block_help)
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads (docs/architecture.md §9: 2)")
    parser.add_argument("--override", action="append", default=[], help=override_help)
    parser.add_argument("--strict", action="store_true",
                        help="refuse (exit status 3) a ratio whose sides did unequal work (bench/README.md)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                        help="tiny: the default task, ~3-token answers; long: arithmetic_cot, 30-256 tokens, "
                             "wider model; medium: a 159M-parameter Qwen3 of random weights, 128-token prompts, "
                             "256-token completions (bench/medium.py)")
    parser.add_argument("--medium", action="append", default=[], metavar="KEY=VALUE",
                        help="--workload medium: change its shape (bench/medium.py SHAPE: dims, lengths, batch), "
                             "e.g. hidden=64 layers=2 for a smoke run")
    return parser


def rounds_parser(description: str, repeats_help: str) -> argparse.ArgumentParser:
    """The options of a benchmark that times variants on the same input in rounds (micro_batches.py,
    generation.py): the long workload by default, `--repeats` timed rounds after `--warmup` untimed ones."""
    parser = bench_parser(description, steps_help=argparse.SUPPRESS, block_help=argparse.SUPPRESS,
                          warmup_help="untimed rounds first", override_help="extra Hydra override")
    parser.add_argument("--repeats", type=int, default=5, help=repeats_help)
    parser.set_defaults(workload="long", warmup=1)
    return parser


def workload_overrides(args: argparse.Namespace) -> list[str]:
    """The Hydra overrides of `args.workload` on top of the reference workload; for the medium one, its model and
    prompts (built once; `args.medium_shape` and `args.medium_paths` are set)."""
    if args.workload != "medium":
        return [f"{k}={v}" for k, v in WORKLOADS[args.workload].items()]
    args.medium_shape = medium.parse_shape(args.medium)
    args.medium_paths = medium.build(args.medium_shape, cache_dir())
    return medium.overrides(args.medium_shape, args.medium_paths)


def rotated(names: list[str], round_index: int) -> list[str]:
    """`names` starting at position `round_index`: each variant runs first in turn, so load swings hit all alike."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def parse_bench_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, check the step counts, and quiet the libraries."""
    args = parser.parse_args(argv)
    if args.medium and args.workload != "medium":
        raise SystemExit(f"--medium {args.medium[0]}: only with --workload medium")
    # the long workload is overrides on top of the reference one; the user's own --override come last and win
    args.override = workload_overrides(args) + args.override
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    quiet(args.threads)
    return args

def median(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def mean(values: Iterable[Optional[float]]) -> float:
    """The mean, nan when there are no values or one is missing."""
    values = list(values)
    return math.nan if not values or None in values else statistics.fmean(values)


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Human-readable lines, or (with --json) the one JSON object on the last line (NaN becomes null)."""

    def tidy(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: tidy(v) for k, v in value.items()}
        if isinstance(value, float):
            return float(f"{value:.6g}") if math.isfinite(value) else None
        return value

    rounded = tidy(result)
    if as_json:
        print(json.dumps(rounded), flush=True)
    else:
        for key, value in rounded.items():
            print(f"{key:>28}: {value}")


# -- equal work ------------------------------------------------------------------------------------------------------
WORK_KEYS = ("tokens", "gen_flops", "update_flops")  # per step: generated tokens, model FLOPs of each phase
# what 3PO's sampled weights add to a step by design (docs/mfu.md "Prefills")
WEIGHT_SAMPLES_BY_DESIGN = ("{name} prefills each prompt once per weight sample (N = {n}; GRPO once): those extra "
                            "generation FLOPs are the algorithm's own")


def weight_samples(cfg: Any) -> int:
    """How many weight samples generate a step of `cfg` (3PO's C3PO and M3PO: N; otherwise 1)."""
    noise = (cfg.algorithm.get("callbacks") or {}).get("param_noise")
    if noise is None or noise.get("generate", "samples") != "samples" or noise.get("variant") not in ("c3po", "m3po"):
        return 1
    return int(noise.get("num_samples", 1))


def spread(values: Iterable[Optional[float]]) -> float:
    """How far apart non-negative figures are: largest / smallest − 1 (0 when equal, inf when only the smallest
    is 0, nan when one is missing)."""
    values = [math.nan if v is None else float(v) for v in values]
    if any(math.isnan(v) for v in values):
        return math.nan
    lo, hi = min(values), max(values)
    return 0.0 if hi == lo else math.inf if lo <= 0 else hi / lo - 1


def within(values: Iterable[Optional[float]], tol: float) -> bool:
    """True when the largest figure is at most (1 + tol) × the smallest (a missing one never is)."""
    values = [math.nan if v is None else float(v) for v in values]
    return not any(math.isnan(v) for v in values) and max(values) <= min(values) * (1 + tol)


def equal_work(sides: dict[str, dict[str, Optional[float]]], tol: float = EQUAL_WORK_TOL,
               by_design: Optional[str] = None) -> dict[str, Any]:
    """The entry a ratio of configurations carries beside it: each side's work per step (`tokens` generated,
    model FLOPs `gen_flops` and `update_flops`, docs/mfu.md), how far apart the sides' tokens and total FLOPs are
    (`spread`), and `equal_work`: both within `tol`. `by_design` says why the work differs when the comparison is
    meant so (e.g. TRL prefills every row): stated beside the flag, which stays as measured."""
    if not 0 <= tol < 1:
        raise ValueError(f"equal-work tolerance {tol!r}: a fraction in [0, 1), e.g. {EQUAL_WORK_TOL}")
    if len(sides) < 2:
        raise ValueError(f"equal_work compares two or more sides, got {sorted(sides)}")
    figures = {name: {k: side.get(k) for k in WORK_KEYS} for name, side in sides.items()}
    for side in figures.values():
        gen, update = side["gen_flops"], side["update_flops"]
        side["flops"] = None if gen is None or update is None else gen + update
    tokens = [side["tokens"] for side in figures.values()]
    flops = [side["flops"] for side in figures.values()]
    entry = {"sides": figures, "tokens_spread": spread(tokens), "flops_spread": spread(flops), "tol": tol,
             "equal_work": within(tokens, tol) and within(flops, tol)}
    if by_design:
        entry["by_design"] = by_design
    return entry


def describe_work(entry: dict[str, Any]) -> str:
    """One line of an `equal_work` entry's figures: each side's tokens and FLOPs per step, and their spread."""
    def number(v: Optional[float]) -> str:
        return "n/a" if v is None or not math.isfinite(v) else f"{v:.4g}"

    sides = "; ".join(f"{name} {number(s['tokens'])} tokens, {number(s['flops'])} FLOPs (generation "
                      f"{number(s['gen_flops'])} + update {number(s['update_flops'])})"
                      for name, s in entry["sides"].items())
    line = (f"{sides} per step: tokens {number(100 * entry['tokens_spread'])} % apart, FLOPs "
            f"{number(100 * entry['flops_spread'])} % (tolerance {number(100 * entry['tol'])} %)")
    return line + (f"; by design: {entry['by_design']}" if "by_design" in entry else "")


def report(result: dict[str, Any], args: argparse.Namespace, script: str) -> None:
    """`emit(result)`, with the equal-work check: every entry `<ratio>_work` whose sides did unequal work is named
    on stderr (and `result["equal_work"]` is false); with `--strict` the result is refused instead: exit status 3,
    naming both sides' figures."""
    entries = {key.removesuffix("_work"): v for key, v in result.items()
               if key.endswith("_work") and isinstance(v, dict) and "equal_work" in v}
    unequal = {ratio: entry for ratio, entry in entries.items() if not entry["equal_work"]}
    if entries:
        result["equal_work"] = not unequal
    for ratio, entry in unequal.items():
        print(f"{script}: {ratio} compares unequal work: {describe_work(entry)}", file=sys.stderr, flush=True)
    if unequal and getattr(args, "strict", False):
        print(f"{script}: --strict: refused, {', '.join(unequal)} compared unequal work (figures above)",
              file=sys.stderr, flush=True)
        raise SystemExit(3)
    emit(result, args.json)


def context() -> dict[str, Any]:
    """What a reader needs beside the numbers: the machine's load, the threading settings, and what sets a CPU's
    matmul speed (two machines' MFU may differ by these): torch's kernel level (`cpu_capability`: AVX2, AVX512), its
    BLAS, and how many cores this process's CPUs are on (two hyperthreads of one core share its FMA units)."""
    import torch

    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        load = "n/a"
    from lit_rlvr.run.perf import cpu_name

    blas = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return {"loadavg": load, "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": blas.group(1) if blas else None,
            "logical_cpus": len(cpus), "physical_cores": physical_cores(cpus)}


def physical_cores(cpus: Iterable[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> Optional[int]:
    """How many cores the logical CPUs `cpus` are on, as the (guest's) sysfs describes them: CPUs that list the same
    siblings share a core. None where sysfs does not say."""
    try:
        return len({(sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip() for cpu in cpus})
    except OSError:
        return None


# -- the reference workload ----------------------------------------------------------------------------------------
def has_value_prior(algorithm: str) -> bool:
    return "v05" in algorithm


def compose(algorithm: str, overrides: Iterable[str] = ()) -> Any:
    """The run config of `algorithm` from conf/, with the reference workload's overrides (docs/architecture.md §9).

    V0.5 keeps its shipped k_init (its module group_size follows k_init and is not used); `--override` can
    change anything, e.g. `algorithm.callbacks.value_prior.k_init=8`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import lit_rlvr.config.schemas  # noqa: F401  (registers the groups' typed schemas that conf/config.yaml names)

    reference = dict(REFERENCE)
    if has_value_prior(algorithm):
        reference.pop("algorithm.group_size")
    extra = [f"{k}={v}" for k, v in reference.items()]
    # no CSV logger (it needs a Hydra run dir) and no progress bar: the benchmark records its own metrics
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=[f"algorithm={algorithm}", "~logger", "callbacks.progress=null",
                                                  *extra, *overrides])


def cache_dir() -> str:
    """The run cache dir conf/config.yaml resolves (`LIT_RLVR_CACHE`, else ~/.cache/lit_rlvr)."""
    from lit_rlvr.run.cache_entry import default_cache_dir

    return default_cache_dir()


def model_path(cfg: Any) -> str:
    """The directory of the (warm-started, cached) model of `cfg`."""
    from omegaconf import OmegaConf

    from lit_rlvr.rollout.warmup import resolve_model_path

    return resolve_model_path(cfg.model.name_or_path, OmegaConf.to_container(cfg.model.options, resolve=True))


def timed(fn: Callable, record: Callable[[float], None]) -> Callable:
    """`fn`, passing the seconds of each call to `record` (also when it raises)."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter() - t0)
    return wrapper


def generated_tokens(module: Any) -> Optional[int]:
    """The response tokens `module` (an `RLVRModule`) has generated so far, or None for another module."""
    counters = getattr(module, "counters", None)
    return None if counters is None else int(counters["tokens_generated"])


class StepRecorder(Callback):
    """Per training step: its wall time (batch start to batch end, so Lightning's own work is in it) and the
    module's logged step metrics. With a baton, set-up and each step first wait for their turn."""

    def __init__(self, name: str, baton: Optional["Baton"] = None):
        self.name, self.baton = name, baton
        self.rows: list[dict[str, float]] = []
        self._t0 = 0.0
        self._timed: dict[str, float] = {}  # per step: seconds spent in the calls `time_calls` wraps
        self._tokens0: Optional[int] = None

    def time_calls(self, owner: Any, name: str, key: str) -> None:
        """Add the time spent in `owner.name` (a class's method or an object's) to each step's row as `key`."""
        self._timed[key] = 0.0

        def add(seconds: float) -> None:
            self._timed[key] += seconds

        setattr(owner, name, timed(getattr(owner, name), add))

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        # 3PO: IVON's noise draws are work a GRPO step does not have, so their time is a floor for c3po_over_grpo
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "_standard_normal"):
                self.time_calls(optimizer, "_standard_normal", "noise_s")

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.baton is not None:  # model set-up (e.g. V0.5's backbone) runs in turn, too
            self.baton.acquire(self.name, count=False)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.baton is not None:
            self.baton.acquire(self.name)
        self._timed = dict.fromkeys(self._timed, 0.0)
        self._tokens0 = generated_tokens(pl_module)
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        wall = time.perf_counter() - self._t0
        source = trainer.callback_metrics or getattr(pl_module, "step_metrics", {})
        row = {"wall_s": wall, **{k: float(v) for k, v in source.items() if k in METRICS}, **self._timed}
        if self._tokens0 is not None:  # the response tokens the step generated (equal work)
            row["tokens"] = float(generated_tokens(pl_module) - self._tokens0)
        self.rows.append(row)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self.baton is not None:
            self.baton.finish(self.name)

    @override
    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.baton is not None:
            self.baton.finish(self.name)


def build_run(cfg: Any, steps: int, recorder) -> tuple[Any, Any, Any]:
    """(module, datamodule, trainer) for `steps` RL steps: no validation, no checkpoints, no logger."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lit_rlvr.app.recipe import build_module

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    callbacks = [instantiate(node) for node in (cfg.algorithm.get("callbacks") or {}).values() if node is not None]
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    kwargs.update(max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  num_sanity_val_steps=0, log_every_n_steps=1)
    for key in ("check_val_every_n_epoch", "val_check_interval", "strategy"):
        kwargs.pop(key, None)
    trainer = pl.Trainer(**kwargs, callbacks=[recorder, *callbacks], default_root_dir=str(ROOT / ".cache" / "bench"))
    return build_module(cfg), instantiate(cfg.data), trainer


# -- taking turns ------------------------------------------------------------------------------------------------------
class Baton:
    """Runs several blocking training loops in separate processes, one at a time: `block` steps each, in turn.

    A participant calls `acquire(name)` before each step (it returns when that step may run) and `finish(name)`
    when it is done; a finished participant's turns are skipped. Only the holder computes, so the timed steps
    never overlap, yet all of them see the machine's load of the same minutes.

    Processes, not threads: every thread that calls torch gets its own OpenMP team, and libgomp throttles the
    spin-wait of all teams to ~nothing once their threads outnumber the cores. Two trainers in threads then paid
    a thread wake-up per op (GRPO 0.053 s side by side against 0.036 s alone, measured), which shrank every
    ratio towards 1. A process has its own libgomp: each side runs as it would alone."""

    def __init__(self, names: list[str], block: int = 1):
        if block < 1:
            raise ValueError(f"--block must be >= 1, got {block}")
        ctx = multiprocessing.get_context("spawn")
        self.order, self.block = list(names), block
        self._turn = ctx.Value("i", 0, lock=False)  # guarded by cond
        self._count = ctx.Value("i", 0, lock=False)
        self._done = ctx.Array("b", len(self.order), lock=False)
        self.cond = ctx.Condition()

    def acquire(self, name: str, count: bool = True) -> None:
        me = self.order.index(name)
        with self.cond:
            if self._turn.value == me and count and self._count.value >= self.block:
                self._advance()  # my block is over: pass on, then wait for my next turn
            self.cond.wait_for(lambda: self._turn.value == me)
            self._count.value += int(count)

    def finish(self, name: str) -> None:
        me = self.order.index(name)
        with self.cond:
            self._done[me] = True
            if self._turn.value == me:
                self._advance()

    def _advance(self) -> None:
        n = len(self.order)
        for i in range(1, n + 1):
            nxt = (self._turn.value + i) % n
            if not self._done[nxt]:
                self._turn.value, self._count.value = nxt, 0
                break
        self.cond.notify_all()


def _participant(name: str, job: Callable[..., Any], args: tuple, baton: Baton, threads: int, results) -> None:
    """A child process: quiet the libraries, run `job(*args, baton)`, send back ("ok", value) or ("error", text)."""
    try:
        quiet(threads)
        results.put((name, "ok", job(*args, baton)))
    except BaseException as err:  # reported by the parent; the others must go on
        import traceback

        results.put((name, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        baton.finish(name)


def run_in_turns(jobs: dict[str, tuple[Callable[..., Any], tuple]], baton: Baton, threads: int = THREADS
                 ) -> tuple[dict[str, Any], dict[str, str]]:
    """Run each job — `(function, args)`, called as `function(*args, baton)` in its own process, a module-level
    function that returns something picklable — under `baton`. Returns (values, errors) by name."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_participant, args=(name, fn, args, baton, threads, results), name=f"bench-{name}")
             for name, (fn, args) in jobs.items()]
    for proc in procs:
        proc.start()
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    while len(values) + len(errors) < len(procs):
        try:
            name, status, payload = results.get(timeout=5.0)
            (values if status == "ok" else errors)[name] = payload
        except queue.Empty:  # a child that died without a word (e.g. killed) must not hang the others
            for name, proc in zip(jobs, procs):
                if not proc.is_alive() and name not in values and name not in errors:
                    errors[name] = f"process exited with code {proc.exitcode} and no result"
                    baton.finish(name)
    for proc in procs:
        proc.join()
    return values, errors


def work_per_step(rows: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Means over the timed steps of the generated tokens and each phase's model FLOPs (`equal_work`'s side)."""
    timed = rows[warmup:]

    def flops(phase: str, seconds: str) -> list[Optional[float]]:
        return [r[f"perf/flops_per_s_{phase}"] * r[seconds] if f"perf/flops_per_s_{phase}" in r else None
                for r in timed]

    return {"tokens": mean([r.get("tokens") for r in timed]), "gen_flops": mean(flops("gen", "time/gen_s")),
            "update_flops": mean(flops("update", "time/train_s"))}


def summarise_rows(rows: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Medians over the timed steps (warm-up steps dropped)."""
    timed = rows[warmup:]
    col = lambda key: [r[key] for r in timed if key in r]  # noqa: E731
    out = {
        "median_step_s": median(col("wall_s")),
        "module_step_s": median(col("time/step_s")),
        "tokens_per_s": median(col("perf/tokens_per_s")),
        "gen_s": median(col("time/gen_s")),
        "reward_s": median(col("time/reward_s")),
        "train_s": median(col("time/train_s")),
        "sync_s": median(col("time/sync_s")),
        "rollouts_per_step": median(col("rollouts/per_step")),
        "response_len_mean": median(col("response/len_mean")),
    }
    if col("perf/mfu_update"):  # model FLOPs utilisation (lit_rlvr.run.perf) and each phase's model FLOPs per step
        out["mfu_gen"], out["mfu_update"] = median(col("perf/mfu_gen")), median(col("perf/mfu_update"))
        out["gen_flops"] = median(r["perf/flops_per_s_gen"] * r["time/gen_s"] for r in timed)
        out["update_flops"] = median(r["perf/flops_per_s_update"] * r["time/train_s"] for r in timed)
    if col("response/len_max"):  # the long workload's length spread, and what a micro-batch computes on padding
        out["response_len_max"] = max(col("response/len_max"))
    if col("micro/padding_frac"):
        out["padding_frac"] = median(col("micro/padding_frac"))
    for key in ("noise_s", "gen_forward_s"):  # recorded by `StepRecorder.time_calls`
        if col(key):
            out[key] = median(col(key))
    if col("time/prior_s"):
        out["prior_s"] = median(col("time/prior_s"))
        out["prior_frac"] = out["prior_s"] / out["module_step_s"]  # of the module's step, which contains it
        out["prior_present_frac"] = statistics.fmean(col("v05/prior_present")) if col("v05/prior_present") else math.nan
        # the mean too: steps that search the kernel bandwidth again cost more than the median step
        out["prior_frac_mean"] = statistics.fmean(col("time/prior_s")) / out["module_step_s"]
        # features computed ahead of the steps (V0.5 `precompute`), warm-up included: outside prior_s
        ahead = [r.get("time/prior_setup_s", 0.0) + r.get("time/prior_prefetch_s", 0.0) for r in rows]
        out["prior_ahead_s"] = sum(ahead)
        out["prior_ahead_per_step_s"] = sum(ahead) / len(rows)
    return out
