"""Small-scale reproduction of the papers' claims on a built-in task (tiny model, CPU), several seeds per method.

The claims (docs/architecture.md §5-6): V0.5 with k_init = 4 (OSLA up to 16) beats GRPO with G = 16, with fewer
rollouts, a lower and steadier gradient norm, higher entropy and a lower baseline MSE; C3PO (N = 4) beats GRPO at
the same cost (G = 16) in accuracy and pass@k, with fewer zero-advantage groups and fewer malformed rollouts; the two
compose; LoRA adapters train as well as full weights. This script runs the methods (GRPO G = 16 and G = 4, V0.5,
C3PO, C3PO + V0.5, and on the chain-of-thought task GRPO and C3PO on rank-8 LoRA adapters), several seeds each, at
equal optimizer steps, each run an ordinary `python train.py` (the real recipe) with every setting the comparison
depends on pinned in `scripts/reproduce_settings.py`, plus the `OracleBaseline` measurement callback
(lit_rlvr.callbacks.oracle_baseline) and held-out evaluations every few steps. It writes the table (mean ± sd over
seeds), paired comparisons for each claim, the command, machine and wall time to a markdown file, two figures
(held-out accuracy curves, mean and band over seeds, against steps and rollouts; the training panels of
lit_rlvr.run.report) and every per-run figure as JSON (per method, per seed under `seeds`).

    nice -n 5 python scripts/reproduce.py                          # runs/reproduce/arithmetic/reproduction.md
    nice -n 5 python scripts/reproduce.py --doc docs/results/reproduction.md      # the committed page (3-token task)
    nice -n 5 python scripts/reproduce.py --task arithmetic_cot --doc docs/results/reproduction_cot.md
    python scripts/reproduce.py --steps 2 --seeds 1 --methods grpo_g4,v05 --batch-size 4 --num-test 16 \\
        --out-dir /tmp/repro                                       # a smoke run: /tmp/repro/arithmetic/reproduction.md

Runs go to `--out-dir/<task>/<method>/seed<k>`; a run whose summary.json exists and whose settings are the same is
reused, and an unfinished one with the same settings continues from its last checkpoint (`resume=`), so an
interrupted reproduction goes on where it stopped; `--force` runs everything again. The hand-written analysis in
the doc, between `<!-- analysis:start -->` and `<!-- analysis:end -->`, is kept when the doc is written again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reproduce_report import (claims_table, exploration_figure, heldout_figure, mean_sd,  # noqa: E402
                              passk_figure, results_table, write_doc)
from reproduce_settings import (FIGURES, LABELS, PROBE_OVERRIDES, PROBED, RIVALS_SCALE,  # noqa: E402
                                RIVALS_TRAIN, RUN, SAMPLING, STUDY_3PO, STUDY_RIVALS, TASKS, Task, ess_of_methods,
                                is_async, method_overrides)

ORACLE = "callbacks.oracle"
PANELS = [
    ("reward/accuracy", "Train rollout accuracy (dots = held-out)", "accuracy"),
    ("loss/entropy", "Policy entropy", "nats / token"),
    ("grad/norm", "Gradient norm (before clipping)", "L2 norm"),
    ("groups/zero_adv_frac", "Groups with all rewards equal", "fraction of groups"),
    ("repro/baseline_mse", "Baseline MSE vs oracle (sampled steps)", "MSE (reward scale ±1)"),
    ("response/len_mean", "Completion length", "tokens"),
]
SCALE_HELP = {"steps": "optimizer steps per run (equal for every method)", "batch_size": "prompts per RL step",
              "num_test": "held-out prompts", "eval_samples": "held-out samples per prompt (mean@k, pass@k; T = 1)",
              "eval_every": "held-out evaluation every n steps during training (0: before and after only)",
              "oracle_every": "oracle baseline on every n-th step (0: no oracle)",
              "oracle_samples": "oracle rollouts per prompt"}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="arithmetic", choices=list(TASKS),
                        help="the task and its pinned settings (scripts/reproduce_settings.py)")
    for name, text in SCALE_HELP.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"{text} (default: the task's)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per method")
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of {', '.join(LABELS)} "
                                                        "(default: the task's, or the study's)")
    parser.add_argument("--study", default="claims", choices=list(STUDIES),
                        help="claims: the papers' claims (the task's methods and page); 3po: 3PO's noise scale, "
                             "exploration against the optimizer, dead groups and N (docs/results/reproduction_3po.md); "
                             "rivals: V0.5 and 3PO against DBB, allocation rules and boundary gating, on a fixed "
                             f"set of {RIVALS_TRAIN} training prompts (docs/results/rivals.md)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: write the doc from the runs that have finished with the same settings "
                             "(each claim paired on the seeds both methods have)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each gets threads/jobs torch threads)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all")
    parser.add_argument("--out-dir", default="runs/reproduce", help="run directories (a folder per task below it)")
    parser.add_argument("--doc", default=None, help="markdown report (default: <out-dir>/<task>/, beside the runs; the "
                                                    "committed docs/results/ page only when named here)")
    parser.add_argument("--force", action="store_true", help="run again even where a finished run exists")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a train.py override after the pinned ones (repeatable): the same comparison with a "
                             "setting changed, e.g. a smaller warm-up for a smoke run; it shows in the doc's command")
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    if args.study == "3po" and args.oracle_every is None:
        args.oracle_every = 0  # the baseline's MSE is not the study's question: its oracle's rollouts are saved
    if args.study == "rivals":  # pass@k up to 16 (from 16 held-out samples); no oracle
        for name, value in RIVALS_SCALE.items():
            setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    for name in SCALE_HELP:
        if getattr(args, name) is None:
            setattr(args, name, task.scale[name])
    default_methods = {"claims": task.methods, "3po": STUDY_3PO, "rivals": STUDY_RIVALS}[args.study]
    args.methods = (default_methods if args.methods is None
                    else [m.strip() for m in args.methods.split(",") if m.strip()])
    unknown = [m for m in args.methods if m not in LABELS]
    if unknown or not args.methods:
        parser.error(f"--methods: unknown {unknown}; valid: {', '.join(LABELS)}")
    if min(args.steps, args.seeds, args.batch_size, args.jobs, args.threads) < 1:
        parser.error("--steps, --seeds, --batch-size, --jobs and --threads must be >= 1")
    if args.eval_every < 0 or args.oracle_every < 0:
        parser.error("--eval-every and --oracle-every must be >= 0")
    # a smoke or partial run must not overwrite the committed results page: that page is written only when named
    page = Path(task.doc).name if args.study == "claims" else STUDIES[args.study]
    args.doc = args.doc or str(Path(args.out_dir) / task.name / page)
    return args


STUDIES = {"claims": None, "3po": "reproduction_3po.md", "rivals": "rivals.md"}  # study -> its page (claims: task's)


def overrides(task: Task, method: str, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """Every override of one run: pinned settings, the method's, the scale, the oracle callback."""
    scale = [f"seed={seed}", f"trainer.max_steps={args.steps}", f"data.batch_size={args.batch_size}",
             f"data.num_test={args.num_test}", f"algorithm.eval_samples={args.eval_samples}"]
    if args.eval_every:  # Lightning validates every n training batches (one batch = one RL step here)
        scale += [f"trainer.val_check_interval={args.eval_every}", "trainer.check_val_every_n_epoch=null"]
    oracle = [f"+{ORACLE}._target_=lit_rlvr.callbacks.oracle_baseline.OracleBaseline",
              f"+{ORACLE}.every_n_steps={args.oracle_every}", f"+{ORACLE}.num_samples={args.oracle_samples}"]
    if is_async(method) or not args.oracle_every:
        oracle = []
    if method in PROBED:
        oracle += PROBE_OVERRIDES
    data = task.data
    if args.study == "rivals":  # a fixed training set the history-based methods see again (reproduce_settings.py)
        data = [o for o in data if not o.startswith("data.num_train=")] + [f"data.num_train={RIVALS_TRAIN}"]
    return [*task.model, *data, *RUN, *SAMPLING, *task.loop, *method_overrides(method, task), *scale, *oracle,
            *args.set, f"hydra.run.dir={run_dir}"]


def finished(summary: Path) -> bool:
    """A summary is also written by a run stopped by a signal: only one that was not stopped is a finished run."""
    if not summary.exists():
        return False
    record = json.loads(summary.read_text())
    return not (record.get("stopped_by_sigterm") or record.get("stopped_by_sigint"))


def finished_run(task: Task, method: str, seed: int, args: argparse.Namespace) -> Optional[Path]:
    """The run dir of (method, seed) when it finished with these exact settings, else None (`--report-only`)."""
    run_dir = (Path(args.out_dir) / task.name / method / f"seed{seed}").resolve()
    settings = run_dir / "repro_overrides.json"
    same = settings.exists() and json.loads(settings.read_text()) == overrides(task, method, seed, args, run_dir)
    return run_dir if same and finished(run_dir / "summary.json") else None


def run_one(task: Task, method: str, seed: int, args: argparse.Namespace) -> tuple[Path, bool]:
    """One `python train.py` run; reused when it finished before with the same overrides, continued from its last
    checkpoint when it stopped before its end."""
    run_dir = (Path(args.out_dir) / task.name / method / f"seed{seed}").resolve()
    ovr = overrides(task, method, seed, args, run_dir)
    settings, last = run_dir / "repro_overrides.json", run_dir / "checkpoints" / "last.ckpt"
    same = settings.exists() and json.loads(settings.read_text()) == ovr and not args.force
    if same and finished(run_dir / "summary.json"):
        print(f"[reuse] {method} seed {seed}", flush=True)
        return run_dir, True
    resume = same and last.exists()
    if not resume and run_dir.exists():  # other settings, or never saved: start clean (no stale rows or checkpoints)
        for stale in ("summary.json", "metrics.csv", "metrics.before_resume.csv", "repro_resumed.json"):
            (run_dir / stale).unlink(missing_ok=True)
        if last.exists():
            last.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(ovr, indent=1))
    threads = str(max(1, args.threads // args.jobs))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    cmd = [sys.executable, "train.py", *ovr, *([f"resume={last}"] if resume else [])]
    if resume:  # the summary's wall time is then this process's only: say so in the figures
        record = run_dir / "repro_resumed.json"
        earlier = json.loads(record.read_text()) if record.exists() else []
        record.write_text(json.dumps([*earlier, time.strftime("%Y-%m-%d %H:%M:%S")]))
    t0 = time.perf_counter()
    with (run_dir / "train.log").open("a" if resume else "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (run_dir / "train.log").read_text()[-3000:]
        raise RuntimeError(f"{method} seed {seed} failed (exit {proc.returncode}); "
                           f"log {run_dir / 'train.log'}:\n{tail}")
    print(f"[done] {method} seed {seed}: {time.perf_counter() - t0:.0f} s{' (resumed)' if resume else ''}",
          flush=True)
    return run_dir, False


# -- reading the runs ---------------------------------------------------------------------------------------------
def load_run(run_dir: Path, oracle_every: int):
    """`report.load_run`, with the oracle's figures kept on the sampled steps only (a run written before the callback
    logged NaN on the other steps has Lightning's repeats of the last sampled value there)."""
    from lit_rlvr.run import report
    from lit_rlvr.callbacks.oracle_baseline import ORACLE_KEYS

    run = report.load_run(run_dir)
    off = run.train["step"] % oracle_every != 0 if oracle_every else run.train["step"] >= 0
    for key in ORACLE_KEYS:
        if key in run.train:
            run.train.loc[off, key] = math.nan
    return run


def heldout_curve(run) -> list[dict[str, float]]:
    """The held-out evaluations of a run in step order (before, during and after training; one per step): step,
    rollouts consumed before it, mean@k and pass@k."""
    val = run.val.dropna(subset=["val/accuracy"]).drop_duplicates("step", keep="last").sort_values("step")
    rollouts = val["rollouts"] if "rollouts" in val else [math.nan] * len(val)
    passes = val["val/pass@k"] if "val/pass@k" in val else [math.nan] * len(val)
    return [{"step": int(s), "rollouts": float(r), "acc": float(a), "pass": float(p)}
            for s, r, a, p in zip(val["step"], rollouts, val["val/accuracy"], passes)]


def run_figures(run_dir: Path, oracle_every: int) -> dict[str, Any]:
    """The table's figures of one run, from its metrics.csv and summary.json."""
    from lit_rlvr.run import report

    run = load_run(run_dir, oracle_every)
    train, summary = run.train, run.summary

    def col(name: str):
        return train[name].dropna() if name in train else train.iloc[:0, 0]

    def mean(name: str) -> float:
        values = col(name)
        return float(values.mean()) if len(values) else math.nan

    grad = col("grad/norm")
    resumed = run_dir / "repro_resumed.json"
    curve = heldout_curve(run)
    # a resumed process does not evaluate before it trains: the start is then the first process's step-0 row
    before = summary["accuracy_before"]
    if before is None:
        before = next((point["acc"] for point in curve if point["step"] == 0), math.nan)
    return {
        "steps": int(summary["steps"]),
        "acc_before": float(before),
        "acc_after": float(summary["accuracy_after"]),
        "acc_gain": float(summary["accuracy_after"]) - float(before),
        "pass_after": float(summary.get("pass_at_k_after") or math.nan),
        "train_acc_tail": report.tail_mean(train, "reward/accuracy"),
        "rollouts": float(summary["rollouts_total"]),
        "tokens": float(summary["tokens_generated"]),
        "grad_mean": float(grad.mean()),
        "grad_std": float(grad.std(ddof=1)) if len(grad) > 1 else math.nan,
        "entropy_tail": report.tail_mean(train, "loss/entropy"),
        "equal_frac": mean("groups/zero_adv_frac"),
        "zero_adv_frac": mean("repro/all_zero_adv_frac"),
        "malformed_frac": mean("reward/malformed_frac"),
        "baseline_mse": mean("repro/baseline_mse"),
        "group_mean_mse": mean("repro/group_mean_mse"),
        "oracle_steps": int(col("repro/baseline_mse").size),
        "len_tail": report.tail_mean(train, "response/len_mean"),
        "clip_tail": report.tail_mean(train, "response/clip_frac"),
        "wall_s": float(summary["wall_s"]),
        "noise_rel": mean("noise/relative"),
        "weight_change": relative_weight_change(run_dir),
        **dead_figures(train),
        "resumed": len(json.loads(resumed.read_text())) if resumed.exists() else 0,
        "curve": curve,
        "pass_ladder": pass_ladder(run, summary, eval_samples_of(run_dir)),
    }


def eval_samples_of(run_dir: Path) -> int:
    """The held-out samples per prompt a run was evaluated with (its pinned `algorithm.eval_samples`; 0: unknown)."""
    settings = run_dir / "repro_overrides.json"
    pinned = json.loads(settings.read_text()) if settings.exists() else []
    return next((int(o.split("=", 1)[1]) for o in reversed(pinned) if o.startswith("algorithm.eval_samples=")), 0)


def pass_ladder(run, summary: dict[str, Any], n: int) -> dict[int, float]:
    """Held-out pass@k after training for k = 1, 2, 4, … up to the evaluation's samples n (pass@1 = mean@n; the
    powers of two below n are `val/pass@k` columns of the last evaluation; pass@n is the summary's)."""
    val = run.val.dropna(subset=["val/accuracy"]).sort_values("step")
    if val.empty:
        return {}
    last = val.iloc[-1]
    ladder = {1: float(summary["accuracy_after"])}
    for column in val.columns:
        if column.startswith("val/pass@") and column[len("val/pass@"):].isdigit() and not math.isnan(last[column]):
            ladder[int(column[len("val/pass@"):])] = float(last[column])
    if summary.get("pass_at_k_after") is not None and n > 1:
        ladder[n] = float(summary["pass_at_k_after"])
    return dict(sorted(ladder.items()))


def dead_figures(train) -> dict[str, float]:
    """The dead-group probe's figures of a run, pooled over its probed steps: the dead share (mean over steps), each
    arm's rescued share over all dead prompts (each step's share weighted by its dead count) and malformed share."""
    probed = train[train["dead/frac"].notna()] if "dead/frac" in train else train.iloc[:0]
    if probed.empty:
        return {key: math.nan for key in ("dead_frac", "rescued_again", "rescued_weights", "rescued_hot",
                                          "malformed_weights", "malformed_hot")}
    dead = probed["dead/frac"]
    figures = {"dead_frac": float(dead.mean())}
    for arm in ("again", "weights", "hot"):
        share = probed[f"dead/rescued_{arm}"]
        weight = dead.where(share.notna(), 0.0)
        figures[f"rescued_{arm}"] = float((share.fillna(0) * weight).sum() / weight.sum()) if weight.sum() else math.nan
    figures.update({f"malformed_{arm}": float(probed[f"dead/malformed_{arm}"].mean()) for arm in ("weights", "hot")})
    return figures


def relative_weight_change(run_dir: Path) -> float:
    """‖θ − θ₀‖ / ‖θ₀‖ of the run's last checkpoint against the warm-up it started from (NaN without either)."""
    import torch
    from safetensors.torch import load_file

    from lit_rlvr.rollout.warmup import resolve_model_path
    from weight_change import weight_change

    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        return math.nan
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    model = checkpoint["hyper_parameters"].get("model") or {}
    if model.get("name_or_path") != "tiny":
        return math.nan
    start = load_file(str(Path(resolve_model_path("tiny", model.get("options") or {})) / "model.safetensors"))
    change = weight_change(start, checkpoint)
    moved = sum(float(d.pow(2).sum()) for d in change.values())
    size = sum(float(start[n].float().pow(2).sum()) for n in change)
    return (moved / size) ** 0.5 if size else math.nan


def mean_run(method: str, run_dirs: list[Path], oracle_every: int):
    """A `report.Run` whose rows are the step-wise means over the seeds' runs."""
    import pandas as pd

    from lit_rlvr.run import report

    runs = [load_run(d, oracle_every) for d in run_dirs]
    train = pd.concat([r.train for r in runs]).groupby("step", as_index=False).mean(numeric_only=True)
    val = pd.concat([r.val for r in runs]).groupby("step", as_index=False).mean(numeric_only=True)
    label = f"{LABELS[method]} — mean of {len(runs)} seed{'s' if len(runs) > 1 else ''}"
    return report.Run(run_dirs[0].parent, label, train, val, {})


def panels_figure(dirs: dict[str, list[Path]], out: Path, oracle_every: int, title: str) -> None:
    from lit_rlvr.run import report
    from reproduce_report import _shrink

    runs = [mean_run(method, paths, oracle_every) for method, paths in dirs.items()]
    panels = [p for p in PANELS if oracle_every or not p[0].startswith("repro/")]  # no oracle: no empty panels
    report.plot(runs, out, panels=panels, title=f"lit-rlvr reproduction on {title}", dpi=60)
    _shrink(out)


# -- the run's context ---------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    import torch

    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def record_invocation(out_dir: Path, info: dict[str, Any]) -> list[dict[str, Any]]:
    """Append this invocation to `out_dir/invocations.json` and return them all: a reproduction continued after an
    interruption (or a doc rewritten from finished runs) still reports the time that trained the runs."""
    path = out_dir / "invocations.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    records = json.loads(path.read_text()) if path.exists() else []
    records.append({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": info["argv"], "commit": info["commit"],
                    "wall_s": round(info["wall_s"], 1), "runs_trained": info["runs_done"],
                    "runs_reused": info["runs_reused"], "load_start": info["load_start"], "load_end": info["load_end"]})
    path.write_text(json.dumps(records, indent=1))
    return records


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from lit_rlvr.run import jsonsafe

    task = TASKS[args.task]
    started, load_start = time.perf_counter(), load_average()
    jobs = [(m, s) for s in range(args.seeds) for m in args.methods]  # seed-major: early seeds finish first
    if args.report_only:  # the finished runs only; a method with none is left out of the doc
        found = [(job, finished_run(task, *job, args)) for job in jobs]
        jobs, done = [j for j, d in found if d is not None], [(d, True) for _, d in found if d is not None]
        if not jobs:
            raise SystemExit(f"--report-only: no finished run under {args.out_dir}/{task.name} with these settings")
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            done = list(pool.map(lambda job: run_one(task, *job, args), jobs))
    methods = [m for m in args.methods if any(mm == m for mm, _ in jobs)]
    dirs = {m: [d for (mm, _), (d, _) in zip(jobs, done) if mm == m] for m in methods}
    per_run = {m: [{**run_figures(d, args.oracle_every), "seed": s} for (mm, s), (d, _) in zip(jobs, done) if mm == m]
               for m in methods}
    for m, runs in per_run.items():
        bad = [r["steps"] for r in runs if r["steps"] != args.steps]
        if bad:
            raise RuntimeError(f"{m}: runs made {bad} steps, not {args.steps} (equal optimizer steps is the point)")
    doc = Path(args.doc)
    figures = [doc.with_name(f"{doc.stem}_heldout.png"), doc.with_suffix(".png")]
    heldout_figure(per_run, figures[0], task.title, args.eval_samples)
    panels_figure(dirs, figures[1], args.oracle_every, task.title)
    if args.study == "3po":
        figures.append(doc.with_name(f"{doc.stem}_exploration.png"))
        exploration_figure(per_run, ess_of_methods(), figures[2], task.title)
    if args.study == "rivals":
        figures.append(doc.with_name(f"{doc.stem}_passk.png"))
        passk_figure(per_run, figures[-1], task.title)
    reused = sum(r for _, r in done)
    info = {"argv": argv, "nice": os.nice(0), "commit": git_commit(), "machine": machine(), "load_start": load_start,
            "load_end": load_average(), "wall_s": time.perf_counter() - started, "runs_done": len(jobs) - reused,
            "runs_reused": reused, "sum_run_s": sum(r["wall_s"] for runs in per_run.values() for r in runs)}
    info["invocations"] = record_invocation(Path(args.out_dir) / task.name, info)
    write_doc(args, task, per_run, figures, doc, info)
    summary = {m: {"label": LABELS[m], "overrides": method_overrides(m, task),
                   "mean": {k: mean_sd([r[k] for r in runs])[0] for k, _ in FIGURES},
                   "sd": {k: mean_sd([r[k] for r in runs])[1] for k, _ in FIGURES},
                   "seeds": runs} for m, runs in per_run.items()}
    raw = {"task": task.name, "settings": vars(args), "pinned": {"model": task.model, "data": task.data,
                                                                 "run": RUN + SAMPLING + task.loop},
           "info": info, "methods": summary}
    doc.with_suffix(".json").write_text(jsonsafe.dumps(raw, indent=1, default=str))  # NaN -> null
    print(results_table(per_run))
    print(claims_table(per_run))
    print(f"doc: {doc}\nfigures: {', '.join(map(str, figures))}\nwall: {info['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
