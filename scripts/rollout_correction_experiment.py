"""The training-inference mismatch on the default task: a bf16 engine without and with verl's rollout correction.

Three arms, the default run (`python train.py`: tiny model, arithmetic levels 2-4, GRPO, G = 8, 64 prompts per
step, 250 steps) with every setting pinned as scripts/reproduce.py pins it, several seeds each:

  fp32        the default engine: HF, shared weights, fp32 (it computes what the trainer computes)
  bf16        HF engine in copy mode with bfloat16 weights (engine.options.dtype=bfloat16), pushes cast to bf16;
              the engine's log-probs are π_old (bypass mode): the mismatch is measured and not corrected
  bf16+corr   the same engine, corrected: algorithm.rollout_correction.rollout_is=token (truncated IS, C = 2) and
              rollout_rs=sequence (sequence ratio kept in [1/2, 2]); decoupled mode (one extra forward per step)

It writes a markdown report (held-out accuracy before / after and during training, the mismatch over training,
the extra cost, per-seed differences) and the per-run figures as JSON.

    nice -n 5 python scripts/rollout_correction_experiment.py --doc docs/results/rollout_correction.md  # committed
    python scripts/rollout_correction_experiment.py --steps 2 --seeds 1 --batch-size 4 --num-test 16 \\
        --val-every 1 --out-dir /tmp/rc           # a smoke run: its report is /tmp/rc/rollout_correction.md

Runs go to `--out-dir/<arm>/seed<k>`; a finished run with the same overrides is reused (`--force` runs it again).
The hand-written analysis between the markers of the doc is kept when the doc is written again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import reproduce as R  # noqa: E402  the pinned settings, machine facts and formatting of the reproduction

LOOP = [o for o in R.LOOP if not o.startswith("engine.options.mode=")]
BF16 = ["engine.options.mode=copy", "engine.options.dtype=bfloat16"]
CORRECTION = "algorithm.rollout_correction"
ARMS: dict[str, tuple[str, list[str]]] = {
    "fp32": ("fp32 engine (shared weights)", ["engine.options.mode=shared", "engine.options.dtype=null"]),
    "bf16": ("bf16 engine, not corrected", BF16),
    "bf16_corr": ("bf16 engine + token TIS (C = 2) + sequence RS ([1/2, 2])",
                  [*BF16, f"{CORRECTION}.rollout_is=token", f"{CORRECTION}.rollout_is_threshold=2.0",
                   f"{CORRECTION}.rollout_rs=sequence", f"{CORRECTION}.rollout_rs_threshold=2.0"]),
}
FIGURES = [("acc_before", "held-out before"), ("acc_after", "held-out after"), ("acc_gain", "gain"),
           ("train_acc_tail", "train reward acc (last 10%)"), ("kl_mean", "mismatch/kl (mean)"),
           ("kl_tail", "mismatch/kl (last 10%)"), ("ppl_ratio_mean", "mismatch/ppl_ratio"),
           ("is_max_max", "max IS weight"), ("rs_frac", "RS rejected"), ("is_clip_frac", "IS truncated"),
           ("step_s", "step s (median)"), ("old_logp_s", "extra forward s (median)")]
DIGITS = {"ppl_ratio_mean": 5, "is_max_max": 2, "step_s": 2, "old_logp_s": 3}
SCIENTIFIC = {"kl_mean", "kl_tail", "rs_frac", "is_clip_frac", "kl_by_step"}  # they span 1e-13 .. 1e-2


def fmt_pm(values: list[float], key: str) -> str:
    """mean ± sd over seeds, in e-notation for the figures that span orders of magnitude."""
    if key not in SCIENTIFIC:
        return R.fmt_pm(values, DIGITS.get(key, 3))
    m, sd = R.mean_sd(values)
    if math.isnan(m):
        return "—"
    return f"{m:.1e}" if math.isnan(sd) else f"{m:.1e} ± {sd:.1e}"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=250, help="RL steps per run (the default run's)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per RL step (the default run's)")
    parser.add_argument("--num-test", type=int, default=256, help="held-out prompts (the default run's)")
    parser.add_argument("--eval-samples", type=int, default=4, help="held-out samples per prompt (mean@k, T = 1)")
    parser.add_argument("--val-every", type=int, default=50, help="held-out evaluation every n steps (0 = ends only)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each gets threads/jobs torch threads)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all")
    parser.add_argument("--out-dir", default="runs/rollout_correction", help="run directories")
    parser.add_argument("--doc", default=None, help="markdown report (default: <out-dir>/rollout_correction.md; "
                                                    "the committed docs/results/ page only when named)")
    parser.add_argument("--force", action="store_true", help="run again even where a finished run exists")
    args = parser.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or any(a not in ARMS for a in args.arms):
        parser.error(f"--arms: valid: {', '.join(ARMS)}")
    if min(args.steps, args.seeds, args.batch_size, args.jobs, args.threads) < 1 or args.val_every < 0:
        parser.error("--steps, --seeds, --batch-size, --jobs and --threads must be >= 1, --val-every >= 0")
    # a smoke or partial run must not overwrite the committed results page: that page is written only when named
    args.doc = args.doc or str(Path(args.out_dir) / "rollout_correction.md")
    return args


def overrides(arm: str, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    scale = [f"seed={seed}", f"trainer.max_steps={args.steps}", f"data.batch_size={args.batch_size}",
             f"data.num_test={args.num_test}", f"algorithm.eval_samples={args.eval_samples}",
             "algorithm=grpo", "algorithm.group_size=8", "algorithm.scale_adv_by_std=true", *R.ADAMW]
    val = [f"trainer.val_check_interval={args.val_every}", "trainer.check_val_every_n_epoch=null"] \
        if args.val_every else []
    return [*R.MODEL, *R.DATA, *LOOP, *ARMS[arm][1], *scale, *val, f"hydra.run.dir={run_dir}"]


def run_one(arm: str, seed: int, args: argparse.Namespace) -> tuple[Path, bool]:
    """One `python train.py` run (log in its train.log); reused when it finished before with the same overrides."""
    run_dir = (Path(args.out_dir) / arm / f"seed{seed}").resolve()
    ovr = overrides(arm, seed, args, run_dir)
    settings = run_dir / "overrides.json"
    if not args.force and (run_dir / "summary.json").exists() and settings.exists() \
            and json.loads(settings.read_text()) == ovr:
        print(f"[reuse] {arm} seed {seed}", flush=True)
        return run_dir, True
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").unlink(missing_ok=True)
    settings.write_text(json.dumps(ovr, indent=1))
    threads = str(max(1, args.threads // args.jobs))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    t0 = time.perf_counter()
    with (run_dir / "train.log").open("w") as log:
        proc = subprocess.run([sys.executable, "train.py", *ovr], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed (exit {proc.returncode}); log {run_dir / 'train.log'}:\n"
                           f"{(run_dir / 'train.log').read_text()[-3000:]}")
    print(f"[done] {arm} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir, False


def run_figures(run_dir: Path) -> dict[str, Any]:
    from lit_rlvr.run import report

    run = report.load_run(run_dir)
    train, summary = run.train, run.summary

    def col(name: str):
        return train[name].dropna() if name in train else train.iloc[:0, 0]

    def stat(name: str, how: str) -> float:
        values = col(name)
        return float(getattr(values, how)()) if len(values) else math.nan

    # validation rows in order: before training (step 0), during (Lightning logs the one after update k at step
    # k - 1), after (step = steps); keyed here by the updates the evaluated policy has had
    val = run.val[["step", "val/accuracy"]].dropna() if "val/accuracy" in run.val else run.val.iloc[:0]
    accs = [float(v) for v in val["val/accuracy"]]
    updates = [0] + [int(s) + 1 for s in val["step"][1:-1]] + [int(summary["steps"])] if len(accs) > 1 else []
    return {
        "steps": int(summary["steps"]),
        "acc_before": float(summary["accuracy_before"]), "acc_after": float(summary["accuracy_after"]),
        "acc_gain": float(summary["accuracy_after"]) - float(summary["accuracy_before"]),
        "train_acc_tail": report.tail_mean(train, "reward/accuracy"),
        "kl_mean": stat("mismatch/kl", "mean"), "kl_tail": report.tail_mean(train, "mismatch/kl"),
        "ppl_ratio_mean": stat("mismatch/ppl_ratio", "mean"), "is_max_max": stat("mismatch/is_weight_max", "max"),
        "rs_frac": stat("mismatch/rs_masked_frac", "mean"), "is_clip_frac": stat("mismatch/is_clip_frac", "mean"),
        "step_s": stat("time/step_s", "median"), "old_logp_s": stat("time/old_logp_s", "median"),
        "wall_s": float(summary["wall_s"]),
        "kl_by_step": {int(s) + 1: float(v) for s, v in zip(train["step"], train["mismatch/kl"])},  # RL step
        "val_by_step": dict(zip(updates, accs)),
    }


def results_table(per_run: dict[str, list[dict]]) -> str:
    head = ["arm", "seeds", *[h for _, h in FIGURES]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, runs in per_run.items():
        cells = [ARMS[arm][0], str(len(runs))]
        cells += [fmt_pm([r[key] for r in runs], key) for key, _ in FIGURES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def by_step_table(per_run: dict[str, list[dict]], key: str, steps: list[int], label: str) -> str:
    """Mean ± sd over seeds of a per-step figure at the given steps."""
    head = ["arm", *[f"{label} {s}" for s in steps]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, runs in per_run.items():
        cells = [ARMS[arm][0]]
        for s in steps:
            cells.append(fmt_pm([r[key][s] for r in runs if s in r[key]], key))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_table(per_run: dict[str, list[dict]]) -> str:
    rows = [("bf16", "fp32"), ("bf16_corr", "bf16"), ("bf16_corr", "fp32")]
    head = ["comparison", "figure", "per seed", "mean ± sd", "verdict (difference ≠ 0)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a, b in rows:
        if a not in per_run or b not in per_run:
            continue
        for key in ("acc_after", "acc_gain"):
            diffs = [x[key] - y[key] for x, y in zip(per_run[a], per_run[b])]
            up, down = R.verdict(diffs, +1), R.verdict(diffs, -1)
            verdict = "higher" if up == "supported" else "lower" if down == "supported" else "not resolved"
            lines.append(f"| {ARMS[a][0]} − {ARMS[b][0]} | {key} | {', '.join(f'{d:+.3f}' for d in diffs)} | "
                         f"{R.fmt_pm(diffs, 3)} | {verdict} |")
    return "\n".join(lines) + "\n"


def write_doc(args, per_run, doc: Path, info: dict[str, Any]) -> None:
    nice = f"nice -n {info['nice']} " if info["nice"] else ""
    command = f"{nice}python scripts/rollout_correction_experiment.py" + (" " + shlex.join(info["argv"])
                                                                         if info["argv"] else "")
    marks = sorted({1, *range(25, args.steps + 1, 25), args.steps})
    vals = sorted({s for runs in per_run.values() for r in runs for s in r["val_by_step"]})
    arms = "\n".join(f"* **{ARMS[a][0]}**: `{' '.join(ARMS[a][1])}`" for a in args.arms)
    text = f"""# The training-inference mismatch on the default task, without and with verl's correction

Generated by `scripts/rollout_correction_experiment.py` (tables, command, machine, timing); the analysis at the end is
written by hand and kept when the script writes this file again. The guide: docs/rollout_correction.md.

## Command, machine, time

```bash
{command}
```

* {info['date']}; commit `{info['commit']}`; {info['machine']['cpu']}, {info['machine']['cores']} cores, Python
  {info['machine']['python']}, torch {info['machine']['torch']}; {args.jobs} run(s) at once
{R.timing_lines(info)}
* the machine was shared with other jobs (load averages above, on 2 cores): step times are not benchmarks

## Setup

The default run's task and settings, pinned as scripts/reproduce.py pins them: tiny model (warm-up to held-out
mean@4 0.3), arithmetic levels 2-4, GRPO with G = 8, {args.batch_size} prompts per step, {args.steps} steps, AdamW
lr 3e-4, ≤ 8 new tokens at temperature 1; held-out: {args.num_test} prompts × {args.eval_samples} samples at T = 1
(mean@{args.eval_samples}) before, every {args.val_every or '—'} steps, and after training. Seeds
0..{args.seeds - 1} fix the data order and sampling; the held-out prompts are the same for every run. Arms:

{arms}

The trainer is fp32 in every arm. `mismatch/*` is measured at every step: in the bypass arms from the loss's
own forward (no extra cost), in the corrected arm from the recomputed π_old (one extra no-grad forward, its time
is `time/old_logp_s`).

## Results (mean ± sd over seeds)

{results_table(per_run)}
### Held-out accuracy during training (mean@{args.eval_samples}, after k updates)

Evaluated with each arm's own engine: the bf16 arms sample the held-out answers from bf16 weights too.

{by_step_table(per_run, "val_by_step", vals, "after") if vals else "_(no intermediate evaluations)_"}
### mismatch/kl over training

{by_step_table(per_run, "kl_by_step", marks, "step")}
### Paired by seed

{paired_table(per_run)}
## What this shows

{R.START}
{R.kept_analysis(doc)}
{R.END}
"""
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started, load_start = time.perf_counter(), " ".join(f"{x:.1f}" for x in os.getloadavg())
    jobs = [(a, s) for s in range(args.seeds) for a in args.arms]  # seed-major: early seeds finish first
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(lambda job: run_one(*job, args), jobs))
    per_run = {a: [run_figures(d) for (aa, _), (d, _) in zip(jobs, done) if aa == a] for a in args.arms}
    for arm, runs in per_run.items():
        if any(r["steps"] != args.steps for r in runs):
            raise RuntimeError(f"{arm}: runs made {[r['steps'] for r in runs]} steps, not {args.steps}")
    reused = sum(r for _, r in done)
    info = {"argv": argv, "nice": os.nice(0), "commit": R.git_commit(), "machine": R.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "load_start": load_start,
            "load_end": " ".join(f"{x:.1f}" for x in os.getloadavg()), "wall_s": time.perf_counter() - started,
            "runs_done": len(jobs) - reused, "runs_reused": reused,
            "sum_run_s": sum(r["wall_s"] for runs in per_run.values() for r in runs)}
    info["invocations"] = R.record_invocation(Path(args.out_dir), info)
    doc = Path(args.doc)
    write_doc(args, per_run, doc, info)
    doc.with_suffix(".json").write_text(json.dumps({"settings": vars(args), "info": info, "runs": per_run},
                                                   indent=1, default=str))
    print(results_table(per_run))
    print(paired_table(per_run))
    print(f"doc: {doc}\nwall: {info['wall_s'] / 60:.1f} min; mean seconds per run: "
          f"{statistics.fmean(r['wall_s'] for runs in per_run.values() for r in runs):.0f}")


if __name__ == "__main__":
    main()
