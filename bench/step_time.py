"""Step time of the reference workload (docs/architecture.md §9) through `lightning.Trainer`, or several algorithms
side by side.

    python bench/step_time.py [--json] [--algorithm grpo] [--steps 20] [--warmup 3]
    python bench/step_time.py --compare grpo,c3po [--block 1] [--json]     # c3po_over_grpo, budget ≤ 1.10
    python bench/step_time.py --engines hf,vllm_cpu --override model.name_or_path=DIR [--json]   # vllm_cpu_over_hf

The workload is composed from conf/ with Hydra (`algorithm=NAME data.batch_size=8 algorithm.group_size=8
algorithm.max_new_tokens=24`): the tiny model, 8 prompts × 8 completions, temperature 1.0, one optimizer update
per step, fp32, 2 threads. W warm-up steps run first and are dropped. `median_step_s` is the wall time of a
Lightning training batch (hooks and logging included); `gen_s`, `reward_s`, `train_s`, `sync_s` (and V0.5's
`prior_s`) are the module's own per-step timings; all are medians. For V0.5, `prior_frac` = median(prior_s) /
median(module step) is the ≤ 5% budget, `rollouts_per_step` what OSLA decided to spend; the default warm-up
lasts until its context holds `min_context` records, so the timed steps run with the prior present.
`mfu_gen`, `mfu_update` are the medians of the module's `perf/mfu_*` (docs/mfu.md; budgets on the long workload
0.35 and 0.50), `gen_flops`, `update_flops` the model FLOPs per step, `peak_flops` what the MFU divides by.
`prior_frac_mean` uses the mean prior_s instead; `prior_ahead_s` is the time V0.5 spent computing prompt features
ahead of the steps (`precompute`: at train start and in look-ahead chunks, warm-up included), outside prior_s,
and `prior_ahead_per_step_s` that spread over the run's steps.

`--engines a,b,…` runs one algorithm with each engine config (conf/engine) in turn, one after the other in this
process, and reports `b_over_a` = median step(b) / median step(a). vLLM on a CPU needs head_dim ≥ 32, which the
tiny model's 16 is not: pass a model with larger heads to both (`--override model.name_or_path=DIR`).

`--compare a,b,…` runs the algorithms in processes that take turns (`--block` steps each, never
two at once), and reports each one's medians, peak RSS and `b_over_a` = median step(b) / median step(a). An entry
may carry its own Hydra overrides after `+`, e.g. `--compare grpo,grpo+model.lora.rank=8` (full fine-tuning
against rank-8 LoRA in one run). Each ratio carries `b_over_a_work`: both sides' generated tokens and model FLOPs
per step and `equal_work` (within 3 %; bench/README.md "Equal work"); `--strict` refuses a ratio of unequal work.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BUDGETS = {"c3po_over_grpo": 1.10, "prior_frac": 0.05, **common.MFU_BUDGETS}  # docs/architecture.md §9


def warmup_for(cfg, warmup: int) -> int:
    """V0.5's prior is absent until the context holds min_context records: warm up at least that long."""
    prior = (cfg.algorithm.get("callbacks") or {}).get("value_prior")
    if prior is None:
        return warmup
    return max(warmup, math.ceil(prior.min_context / cfg.data.batch_size))


def entry(name: str, overrides: list[str]) -> tuple[str, list[str]]:
    """`grpo` or `grpo+KEY=VALUE+…`: the algorithm, and the shared overrides followed by the entry's own."""
    algorithm, *own = name.split("+")
    return algorithm, [*overrides, *own]


def run_algorithm(name: str, overrides: list[str], total_steps: int, baton=None) -> dict:
    """One algorithm's run (in this process, or a child of `common.run_in_turns`): its per-step rows and peak RSS."""
    recorder = common.StepRecorder(name, baton)
    module, datamodule, trainer = common.build_run(common.compose(*entry(name, overrides)), total_steps, recorder)
    trainer.fit(module, datamodule=datamodule)
    return {"rows": recorder.rows, "peak_rss_mb": common.peak_rss_mb(), "peak_flops": module.flops.peak}


def measure(algorithms: list[str], steps: int, warmup: int, block: int, overrides: list[str],
            threads: int = common.THREADS) -> tuple[dict[str, dict], float]:
    """Run each algorithm for its warm-up plus `steps` timed steps, several in processes taking turns; returns
    their summaries and the largest peak RSS."""
    warm = max(warmup_for(common.compose(*entry(name, overrides)), warmup) for name in algorithms)
    if len(algorithms) == 1:
        runs = {algorithms[0]: run_algorithm(algorithms[0], overrides, warm + steps)}
    else:
        baton = common.Baton(algorithms, block)
        runs, errors = common.run_in_turns(
            {name: (run_algorithm, (name, overrides, warm + steps)) for name in algorithms}, baton, threads)
        if errors:
            name, err = next(iter(errors.items()))
            raise RuntimeError(f"{name} failed: {err}")
    out = {}
    for name, run in runs.items():
        rows = run["rows"]
        if len(rows) < warm + steps:
            raise RuntimeError(f"{name}: {len(rows)} steps recorded, expected {warm + steps}")
        out[name] = {"algorithm": name, "steps": steps, "warmup": warm, **common.summarise_rows(rows, warm)}
        out[name]["_walls"] = [r["wall_s"] for r in rows[warm:]]
        out[name]["_work"] = common.work_per_step(rows, warm)
        out[name]["_samples"] = common.weight_samples(common.compose(*entry(name, overrides)))
        out[name]["peak_flops"] = run["peak_flops"]  # what mfu_* divide by (lit_rlvr.run.perf)
        out[name]["peak_rss_mb"] = run["peak_rss_mb"]
    return out, max(run["peak_rss_mb"] for run in runs.values())


def private(summary: dict) -> dict:
    """Pop the figures `measure` keeps for the ratios (keys starting with "_") from `summary`, and return them."""
    return {key: summary.pop(key) for key in [k for k in summary if k.startswith("_")]}


def single(args) -> dict:
    summaries, peak_rss = measure([args.algorithm], args.steps, args.warmup, 1, args.override)
    (summary,) = summaries.values()
    private(summary)
    result = {"algorithm": summary.pop("algorithm"), "steps": summary.pop("steps"), **summary,
              "peak_rss_mb": peak_rss, **common.context()}
    if "mfu_update" in result:
        result.update({f"{k}_budget": v for k, v in common.MFU_BUDGETS.items()})
    if "prior_frac" in result:
        result["prior_frac_budget"] = BUDGETS["prior_frac"]
    return result


def flops_floor(base: dict, other: dict) -> float | None:
    """The step ratio other/base if `other` ran its generation and update at `base`'s FLOP rates: base's step with
    each phase's seconds scaled by the phases' model-FLOP ratio (docs/mfu.md). What the ratio owes to more work
    (C3PO: each weight sample prefills its own prompts; longer completions), not to slower code."""
    keys = ("gen_s", "train_s", "gen_flops", "update_flops", "median_step_s")
    if not all(base.get(k) and other.get(k) for k in keys):
        return None
    extra = (base["gen_s"] * (other["gen_flops"] / base["gen_flops"] - 1)
             + base["train_s"] * (other["update_flops"] / base["update_flops"] - 1))
    return 1 + extra / base["median_step_s"]


def by_design(kept: dict[str, dict], sides: tuple[str, str]) -> str | None:
    """Why two algorithms' FLOPs differ by design: 3PO's weight samples each prefill the prompts."""
    samples = {name: kept[name]["_samples"] for name in sides}
    if len(set(samples.values())) == 1:
        return None
    return "; ".join(common.WEIGHT_SAMPLES_BY_DESIGN.format(name=name, n=n) for name, n in samples.items() if n > 1)


def compare(args) -> dict:
    names = [n.strip() for n in args.compare.split(",") if n.strip()]
    if len(names) < 2 or len(set(names)) != len(names):
        raise SystemExit(f"--compare needs two or more different algorithms, got {args.compare!r}")
    summaries, peak_rss = measure(names, args.steps, args.warmup, args.block, args.override, args.threads)
    base = names[0]
    kept = {name: private(summaries[name]) for name in names}
    result = {"compare": names, "steps": args.steps, "block": args.block}
    for name in names[1:]:
        key = f"{name}_over_{base}"
        result[key] = summaries[name]["median_step_s"] / summaries[base]["median_step_s"]
        paired = [b / a for a, b in zip(kept[base]["_walls"], kept[name]["_walls"])]
        result[f"{key}_paired"] = common.median(paired)  # median of step-by-step ratios: robust to load swings
        if "noise_s" in summaries[name] and "noise_s" not in summaries[base]:
            # the noise draws alone, on top of the base step: the ratio cannot go below this
            result[f"{key}_noise_floor"] = 1 + summaries[name]["noise_s"] / summaries[base]["median_step_s"]
        floor = flops_floor(summaries[base], summaries[name])
        if floor is not None:
            result[f"{key}_flops_floor"] = floor
        if key in BUDGETS:
            result[f"{key}_budget"] = BUDGETS[key]
        result[f"{key}_work"] = common.equal_work({n: kept[n]["_work"] for n in (base, name)},
                                                   by_design=by_design(kept, (base, name)))
    for name in names:
        result[name] = {k: v for k, v in summaries[name].items() if k not in ("algorithm", "steps")}
    result.update(peak_rss_mb=peak_rss, **common.context())
    return result


def engines(args) -> dict:
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    if len(names) < 2 or len(set(names)) != len(names):
        raise SystemExit(f"--engines needs two or more different engine configs, got {args.engines!r}")
    result = {"engines": names, "algorithm": args.algorithm, "steps": args.steps}
    peak, work = 0.0, {}
    for name in names:
        summaries, rss = measure([args.algorithm], args.steps, args.warmup, 1, [*args.override, f"engine={name}"])
        (summary,) = summaries.values()
        work[name] = private(summary)["_work"]
        result[name] = {k: v for k, v in summary.items() if k not in ("algorithm", "steps")}
        peak = max(peak, rss)
    for name in names[1:]:
        result[f"{name}_over_{names[0]}"] = result[name]["median_step_s"] / result[names[0]]["median_step_s"]
        result[f"{name}_over_{names[0]}_work"] = common.equal_work({n: work[n] for n in (names[0], name)})
    result.update(peak_rss_mb=peak, **common.context())
    return result


def main(argv=None) -> None:
    parser = common.bench_parser(__doc__.split("\n\n")[0], steps_help="timed RL steps (per algorithm)",
                                 warmup_help="untimed RL steps first (V0.5: at least until its prior is present)",
                                 block_help="with --compare: steps per turn",
                                 override_help="extra Hydra override (repeatable)")
    parser.add_argument("--algorithm", default="grpo", help="a config in conf/algorithm (grpo, c3po, v05, …)")
    parser.add_argument("--compare", default=None, help="comma-separated algorithms run side by side, e.g. grpo,c3po")
    parser.add_argument("--engines", default=None, help="comma-separated engine configs run in turn, e.g. hf,vllm_cpu")
    args = common.parse_bench_args(parser, argv)
    result = engines(args) if args.engines else compare(args) if args.compare else single(args)
    common.report(result, args, "step_time.py")


if __name__ == "__main__":
    main()
