"""Step time and peak memory against completion length, group size and model width: GRPO, C3PO and TRL's
GRPOTrainer side by side at each point (docs/architecture.md §9), written as JSON and drawn as one figure.

    python bench/scaling.py [--axes length,group,width] [--steps 3] [--warmup 1] [--no-trl]
                            [--out docs/results/scaling.json] [--figure docs/results/scaling.png]
    python bench/scaling.py --plot-only [--out …] [--figure …]      # redraw from the JSON

The long workload (8 prompts, the arithmetic_cot task, fp32, 2 threads) with `algorithm.ignore_eos=true`: every
completion is exactly `max_new_tokens` tokens (TRL: `min_new_tokens`), so each axis moves one thing only.
- length: 16, 32, 64, 128, 256 new tokens (G = 8, width 256: the long workload's warmed-up model);
- group: G = 4, 8, 16, 32 completions per prompt (64 tokens, width 256);
- width: hidden size 64, 128, 256, 512 (4 layers, 4 heads; 64 tokens, G = 8): models initialised and trained for
  one warm-up step only (their cost does not depend on what they learned; the 256 one is not the long model).
At each point the three trainers run in processes that take turns, one step at a time (`common.Baton`);
`--warmup` steps are dropped and the median of `--steps` is reported with each process's peak RSS (VmHWM, its
own since it started: the Python process with torch, transformers and the model included; a width's model is
built beforehand in the parent process, so its warm-up is in no trainer's figure). C3PO keeps its shipped N = 4
weight samples.
Growth is summarised by the log-log slope of step time over each axis (1: linear, 2: quadratic): `slopes` over
all points of the axis, `slopes_top` between its last two (where fixed per-call costs weigh least).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import compare_trl  # noqa: E402
import step_time  # noqa: E402

BASE = {"length": 64, "group": 8, "width": 256}
AXES = {"length": [16, 32, 64, 128, 256], "group": [4, 8, 16, 32], "width": [64, 128, 256, 512]}
RUNNERS = ("grpo", "c3po", "trl")


def point_overrides(axis: str, value: int) -> list[str]:
    """Hydra overrides of one point, on top of the long workload."""
    at = {**BASE, axis: value}
    # the algorithm's budget only: task_max_new_tokens would change the warm-up (the model's cache key) too
    out = ["algorithm.ignore_eos=true", f"algorithm.max_new_tokens={at['length']}",
           f"algorithm.group_size={at['group']}"]
    if axis == "width":  # untrained models of each width: their speed is all that is measured
        out += [f"model.options.hidden_size={value}", "model.options.max_steps=1", "model.options.eval_problems=8"]
    return out


def run_point(axis: str, value: int, args) -> dict:
    overrides = [f"{k}={v}" for k, v in common.LONG.items()] + point_overrides(axis, value) + args.override
    total = args.warmup + args.steps
    common.model_path(common.compose("grpo", overrides))  # a new width's model is built here: outside their RSS
    names = [r for r in RUNNERS if r != "trl" or not args.no_trl]
    jobs = {name: (step_time.run_algorithm, (name, overrides, total)) for name in names if name != "trl"}
    if "trl" in names:
        jobs["trl"] = (compare_trl.run_trl, (overrides, total))
    values, errors = common.run_in_turns(jobs, common.Baton(names, 1), args.threads)
    point = {"axis": axis, "value": value, **common.context()}
    work = {}
    for name in names:
        if name in errors:
            point[name] = {"error": errors[name].splitlines()[0]}
            continue
        run = values[name]
        walls = [r["wall_s"] for r in run["rows"]] if "rows" in run else run["walls"]
        entry = {"step_s": common.median(walls[args.warmup :]), "peak_rss_mb": run["peak_rss_mb"]}
        if "rows" in run:
            summary = common.summarise_rows(run["rows"], args.warmup)
            entry.update(gen_s=summary["gen_s"], train_s=summary["train_s"], len_mean=summary["response_len_mean"])
            work[name] = common.work_per_step(run["rows"], args.warmup)
        else:
            entry.update(gen_s=common.median(run["gens"][args.warmup :]),
                         len_mean=common.median(run["lengths"][args.warmup :]))
            work[name] = compare_trl.trl_work(run, args.warmup)
        point[name] = entry
    if len(work) > 1:  # the curves are drawn side by side: what each trainer's step did at this point
        notes = [common.WEIGHT_SAMPLES_BY_DESIGN.format(name="c3po", n=common.weight_samples(
                     common.compose("c3po", overrides)))] if "c3po" in work else []
        notes += [compare_trl.TRL_BY_DESIGN] if "trl" in work else []
        point["work"] = common.equal_work(work, by_design="; ".join(notes) or None)
    return point


def slope(points: list[dict], runner: str) -> float:
    """Least-squares slope of log(step time) against log(axis value)."""
    xy = [(math.log(p["value"]), math.log(p[runner]["step_s"])) for p in points
          if runner in p and p[runner].get("step_s")]
    if len(xy) < 2:
        return math.nan
    mx, my = sum(x for x, _ in xy) / len(xy), sum(y for _, y in xy) / len(xy)
    return sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)


def plot(points: list[dict], figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = [a for a in AXES if any(p["axis"] == a for p in points)]
    fig, grid = plt.subplots(2, len(axes), figsize=(4.2 * len(axes), 7), squeeze=False)
    labels = {"length": "completion length (tokens)", "group": "group size G", "width": "hidden size"}
    for col, axis in enumerate(axes):
        row = sorted((p for p in points if p["axis"] == axis), key=lambda p: p["value"])
        for runner, style in zip(RUNNERS, ("o-", "s-", "^--")):
            have = [p for p in row if p.get(runner, {}).get("step_s")]
            if not have:
                continue
            xs = [p["value"] for p in have]
            grid[0][col].plot(xs, [p[runner]["step_s"] for p in have], style,
                              label=f"{runner} (slope {slope(row, runner):.2f})")
            grid[1][col].plot(xs, [p[runner]["peak_rss_mb"] for p in have], style, label=runner)
        for r, name in ((0, "step time (s)"), (1, "peak RSS (MB)")):
            grid[r][col].set_xscale("log", base=2)
            grid[r][col].set_xlabel(labels[axis])
            grid[r][col].set_ylabel(name)
            grid[r][col].legend(fontsize=8)
        grid[0][col].set_yscale("log", base=2)
    fig.suptitle("lit-rlvr GRPO, C3PO and TRL GRPOTrainer: long workload, fp32, 2 threads (bench/scaling.py)")
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)


def main(argv=None) -> None:
    parser = common.bench_parser(__doc__.split("\n\n")[0], steps_help="timed steps per trainer and point",
                                 warmup_help="untimed steps first", block_help="unused (one step per turn)",
                                 override_help="extra Hydra override for every point")
    parser.add_argument("--axes", default="length,group,width", help="which axes to measure")
    parser.add_argument("--values", default=None, help="comma-separated values (one axis only), e.g. 16,32")
    parser.add_argument("--no-trl", action="store_true", help="GRPO and C3PO only")
    parser.add_argument("--out", default=str(common.ROOT / "docs/results/scaling.json"))
    parser.add_argument("--figure", default=str(common.ROOT / "docs/results/scaling.png"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from --out")
    parser.set_defaults(steps=3, warmup=1)
    args = common.parse_bench_args(parser, argv)
    out = Path(args.out)
    if args.plot_only:
        plot(json.loads(out.read_text())["points"], Path(args.figure))
        return
    axes = [a.strip() for a in args.axes.split(",") if a.strip()]
    unknown = sorted(set(axes) - set(AXES))
    if unknown or (args.values and len(axes) != 1):
        raise SystemExit(f"--axes takes {', '.join(AXES)} (got {unknown or axes}); --values needs exactly one axis")
    points = []
    for axis in axes:
        values = [int(v) for v in args.values.split(",")] if args.values else AXES[axis]
        for value in values:
            points.append(run_point(axis, value, args))
            print(json.dumps(points[-1]), flush=True)  # progress: one line per point
    on = {axis: sorted((p for p in points if p["axis"] == axis), key=lambda p: p["value"]) for axis in axes}
    result = {"steps": args.steps, "warmup": args.warmup, "points": points,
              "slopes": {axis: {r: slope(on[axis], r) for r in RUNNERS} for axis in axes},
              "slopes_top": {axis: {r: slope(on[axis][-2:], r) for r in RUNNERS} for axis in axes}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(points, Path(args.figure))
    common.emit({"out": str(out), "figure": args.figure, "slopes": result["slopes"],
                 "slopes_top": result["slopes_top"],
                 "equal_work": {f"{p['axis']}={p['value']}": p["work"]["equal_work"] for p in points if "work" in p}},
                args.json)


if __name__ == "__main__":
    main()
