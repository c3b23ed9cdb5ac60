"""Asynchronous rollouts against the synchronous step (docs/async.md), on the long workload by default.

    python bench/async_overlap.py [--workload long] [--steps 6] [--warmup 2] [--rounds 3] [--json]

Each configuration runs in a process of its own, one after another, in rounds whose order rotates, so that all
see comparable machine load:

- `sync_1core`: the synchronous run on one core (1 torch thread, pinned to CPU 0). Its `gen_s` and `train_s` are
  "generation alone" and "update alone" on that pinning.
- `async_s1`, `async_s2`: `rollout.mode=async` with S = 1 and 2, the HF engine in a process of its own
  (`engine.options.process=true`). The trainer is pinned to CPU 0 and the engine's process to CPU 1, with 1 torch
  thread each: the pinning the budget names.
- `async_s1_thread`: `async_s1` with the engine in the producer's thread (`process=false`, pinned to CPU 1): both
  threads share one interpreter and its GIL.
- `async_s1_partial`: `async_s1` with partial rollouts (`rollout.partial_rollout=true`: a push lands between two
  decode steps of the batch in flight instead of waiting for its end) and no post-push check
  (`engine.options.sync_check_every=0`, which partial rollouts need; `async_s1` keeps the default check per push).
- `sync_2cores`: the synchronous run on both cores (2 torch threads), the best synchronous use of the machine.

Reported per round, then as the median and the spread over rounds:

- `async_over_ideal` = step(async_s1) / max(gen_s, train_s) of sync_1core. An ideal pipeline takes the longer
  phase; budget ≤ 1.15. `thread_over_ideal`: the same for `async_s1_thread`.
- `async_over_sum` = step(async_s1) / (gen_s + train_s) of sync_1core. The synchronous run on the same pinning
  takes the sum.
- `async_over_sync_2cores` = step(async_s1) / step(sync_2cores).
- `partial_over_async_s1` = step(async_s1_partial) / step(async_s1), and `partial_frac`: the share of trained
  completions that span two policy versions (`async/partial_frac`; 0 when every push meets no generation).
- `trainer_wait_frac_s2`: `async/trainer_wait_frac` at S = 2; budget ≤ 0.10.
- `buffer_peak_mb_s1`, `_s2`: the largest `async/buffer_mb` of the run (the scored batches held when a step takes
  its batch) at S = 1 and 2.
- `rss_async_over_sync`: peak RSS of async_s1's two processes together (the trainer's and the engine's, each its
  own peak) over sync_1core's; budget ≤ 1.5. The engine keeps its own copy of the weights in async mode. Each
  side's peak is reported too (`rss_sync_mb`, `rss_async_trainer_mb`, `rss_async_engine_mb`).

Steps are Lightning training batches (wall time); the first `--warmup` are dropped, which include the calls that
only fill the pipeline.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BUDGETS = {"async_over_ideal": 1.15, "trainer_wait_frac_s2": 0.10, "rss_async_over_sync": 1.5}
PROCESS = ["engine.options.process=true"]
CONFIGS = {  # name: (torch threads, trainer's CPUs, engine's CPUs (its process, else the producer's thread), overrides)
    "sync_1core": (1, {0}, None, []),
    "async_s1": (1, {0}, {1}, ["rollout.mode=async", "rollout.max_staleness=1", *PROCESS]),
    "async_s2": (1, {0}, {1}, ["rollout.mode=async", "rollout.max_staleness=2", *PROCESS]),
    "async_s1_thread": (1, {0}, {1}, ["rollout.mode=async", "rollout.max_staleness=1"]),
    "async_s1_partial": (1, {0}, {1}, ["rollout.mode=async", "rollout.max_staleness=1", "rollout.partial_rollout=true",
                                       "engine.options.sync_check_every=0", *PROCESS]),
    "sync_2cores": (2, None, None, []),
}


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` on `cpus` (threads it starts later inherit its main thread's)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


def run_config(name: str, overrides: list[str], steps: int, results) -> None:
    """One configuration's run in this (child) process; puts its summary on `results`."""
    threads, trainer_cpus, engine_cpus, own = CONFIGS[name]
    common.quiet(threads)
    if trainer_cpus is not None:
        os.sched_setaffinity(0, trainer_cpus)  # this thread (the trainer's)
    from lit_rlvr.rollout.hf_process import HFProcessEngine

    def engine_process(engine) -> list[int]:  # the engine's own process, if it has one here
        return engine.engine_pids() if isinstance(engine, HFProcessEngine) else []

    if engine_cpus is not None:
        from lit_rlvr.rollout.pipeline import Producer

        run = Producer._run

        def pinned_run(self) -> None:
            os.sched_setaffinity(0, engine_cpus)  # the producer's thread
            for pid in engine_process(self.driver.engine):  # and the engine's process
                pin_process(pid, engine_cpus)
            run(self)

        Producer._run = pinned_run
    recorder = common.StepRecorder(name)
    module, datamodule, trainer = common.build_run(common.compose("grpo", [*overrides, *own]), steps, recorder)
    trainer.fit(module, datamodule=datamodule)
    # the engine process's own peak, read before it ends (its ru_maxrss would start at this process's RSS when it
    # was started: see lit_rlvr.run.processes.peak_rss_mb)
    engine_rss = sum(common.peak_rss_mb(pid) for pid in engine_process(module.engine))
    results.put((name, recorder.rows, (common.peak_rss_mb(), engine_rss)))


def one_round(names: list[str], overrides: list[str], steps: int) -> dict[str, tuple[list, tuple[float, float]]]:
    ctx = multiprocessing.get_context("spawn")
    out = {}
    for name in names:  # one at a time: the async run's two threads must have the machine to themselves
        results = ctx.Queue()
        proc = ctx.Process(target=run_config, args=(name, overrides, steps, results))
        proc.start()
        got = results.get(timeout=3600)
        proc.join()
        out[got[0]] = (got[1], got[2])
    return out


def summarise(runs: dict[str, tuple[list, tuple[float, float]]], warmup: int) -> dict[str, float]:
    """One round's medians and ratios."""
    med = {name: common.summarise_rows(rows, warmup) for name, (rows, _) in runs.items()}
    def median_of(key: str, name: str) -> float:
        return common.median(r.get(key) for r in runs[name][0][warmup:])

    def peak_of(key: str, name: str) -> float:  # over every step that logged it (NaN: none did)
        return max((r[key] for r in runs[name][0] if key in r), default=math.nan)

    alone = med["sync_1core"]
    step = {name: m["median_step_s"] for name, m in med.items()}
    return {**{f"{name}_step_s": s for name, s in step.items()},
            "gen_alone_s": alone["gen_s"], "update_alone_s": alone["train_s"],
            "async_over_ideal": step["async_s1"] / max(alone["gen_s"], alone["train_s"]),
            "thread_over_ideal": step["async_s1_thread"] / max(alone["gen_s"], alone["train_s"]),
            "async_over_sum": step["async_s1"] / (alone["gen_s"] + alone["train_s"]),
            "async_over_sync_2cores": step["async_s1"] / step["sync_2cores"],
            "partial_over_async_s1": step["async_s1_partial"] / step["async_s1"],
            "partial_frac": median_of("async/partial_frac", "async_s1_partial"),
            "trainer_wait_frac_s1": median_of("async/trainer_wait_frac", "async_s1"),
            "trainer_wait_frac_s2": median_of("async/trainer_wait_frac", "async_s2"),
            "buffer_peak_mb_s1": peak_of("async/buffer_mb", "async_s1"),
            "buffer_peak_mb_s2": peak_of("async/buffer_mb", "async_s2"),
            "rss_async_over_sync": sum(runs["async_s1"][1]) / runs["sync_1core"][1][0],
            "rss_sync_mb": runs["sync_1core"][1][0],
            "rss_async_trainer_mb": runs["async_s1"][1][0], "rss_async_engine_mb": runs["async_s1"][1][1],
            "_work": {name: common.work_per_step(rows, warmup) for name, (rows, _) in runs.items()}}


# the ratios' sides (async_over_sum has async_over_ideal's): each entry `<ratio>_work` states their work per step
WORK_SIDES = {"async_over_ideal": ("sync_1core", "async_s1"), "thread_over_ideal": ("sync_1core", "async_s1_thread"),
              "async_over_sync_2cores": ("sync_2cores", "async_s1"),
              "partial_over_async_s1": ("async_s1", "async_s1_partial")}


def work(rounds: list[dict]) -> dict[str, dict]:
    """Each ratio's equal-work entry, from its sides' work per step averaged over the rounds (popped from them)."""
    per_round = [r.pop("_work") for r in rounds]
    mean = {name: {k: common.mean(w[name][k] for w in per_round) for k in common.WORK_KEYS} for name in CONFIGS}
    return {f"{ratio}_work": common.equal_work({name: mean[name] for name in sides})
            for ratio, sides in WORK_SIDES.items()}


def main(argv=None) -> None:
    parser = common.bench_parser(__doc__.splitlines()[0], steps_help="timed steps per configuration",
                                 warmup_help="steps dropped first (they include the pipeline's filling calls)",
                                 block_help="unused", override_help="extra Hydra override")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all configurations")
    parser.set_defaults(workload="long", steps=6, warmup=2)
    args = common.parse_bench_args(parser, argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench/async_overlap.py pins the trainer and the producer to two CPUs: this process may "
                         "use fewer")
    names = list(CONFIGS)
    rounds = [summarise(one_round(common.rotated(names, i), args.override, args.warmup + args.steps), args.warmup)
              for i in range(args.rounds)]
    result = {"workload": args.workload, "steps": args.steps, "rounds": args.rounds, **work(rounds)}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        result[key] = statistics.median(values)
        result[f"{key}_spread"] = [min(values), max(values)]
    result.update({f"{k}_budget": v for k, v in BUDGETS.items()})
    result.update(common.context())
    common.report(result, args, "async_overlap.py")


if __name__ == "__main__":
    main()
