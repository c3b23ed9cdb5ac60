"""Small-scale reproduction of the papers' claims on the built-in task (tiny model, arithmetic, CPU).

The claims (docs/architecture.md §5-6): V0.5 with k_init = 4 (OSLA up to 16) beats GRPO with G = 16, with a lower
and steadier gradient norm, higher entropy and a lower baseline MSE; C3PO (N = 4) beats GRPO at the same cost
(G = 16), with fewer zero-advantage groups and fewer malformed rollouts. This script runs GRPO (G = 16),
GRPO (G = 4), V0.5, C3PO (G = 16) and C3PO + V0.5, several seeds each, at equal optimizer steps, each run an
ordinary `python train.py` (the real recipe) with every setting the comparison depends on pinned below, plus the
`OracleBaseline` measurement callback (lit_rlvr.callbacks.oracle_baseline). It then writes the table (mean ± sd
over seeds), paired comparisons for each claim, the command, machine and wall time to a markdown file, the report
figure (lit_rlvr.report, mean curves over seeds) and every per-run figure as JSON.

    nice -n 5 python scripts/reproduce.py                       # the committed run: docs/results/reproduction.md
    python scripts/reproduce.py --steps 2 --seeds 1 --methods grpo_g4,v05 --batch-size 4 --num-test 16 \\
        --out-dir /tmp/repro --doc /tmp/repro/reproduction.md   # a smoke run

Runs go to `--out-dir/<method>/seed<k>`; a run whose summary.json exists and whose settings are the same is
reused (so an interrupted reproduction continues), `--force` runs everything again. The hand-written analysis in
the doc, between `<!-- analysis:start -->` and `<!-- analysis:end -->`, is kept when the doc is written again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# -- the comparison's settings, pinned: a later change of a config default must not change this comparison ------
MODEL = ["model=tiny", "model.dtype=float32", "model.options.target=0.3", "model.options.max_steps=2000",
         "model.options.eval_every=25", "model.options.eval_problems=256", "model.options.eval_samples=4",
         "model.options.batch_size=64", "model.options.lr=0.001", "model.options.warmup_steps=80",
         "model.options.seed=0", "++model.options.levels=[2,3,4]"]  # warm-up: stops at held-out mean@4 0.3
DATA = ["data=arithmetic", "reward=arithmetic", "data.levels=[2,3,4]", "data.split_seed=0", "data.num_train=100000",
        "data.eval_batch_size=128"]
LOOP = ["engine=hf", "engine.options.mode=shared", "trainer=cpu", "logger=csv", "callbacks.progress=null",
        "eval_before=true", "checkpoint_every=1000000", "algorithm.max_new_tokens=8", "algorithm.temperature=1.0",
        "algorithm.top_p=1.0", "algorithm.top_k=0", "algorithm.eval_temperature=1.0", "algorithm.kl_coef=0.0",
        "algorithm.entropy_coef=0.0", "algorithm.ppo_epochs=1", "algorithm.mini_batches=1", "algorithm.eps_low=0.2",
        "algorithm.eps_high=0.2", "algorithm.loss_aggregation=seq-mean-token-mean", "algorithm.micro_batch_size=64",
        "algorithm.warmup_steps=0"]
ADAMW = ["++algorithm.optimizer=adamw", "algorithm.lr=0.0003", "algorithm.weight_decay=0.0", "algorithm.grad_clip=1.0"]
IVON = ["algorithm.optimizer=ivon", "algorithm.lr=0.03", "algorithm.grad_clip=0.0", "algorithm.weight_decay=0.0",
        "algorithm.optimizer_options.ess=100000000.0", "algorithm.optimizer_options.hess_init=0.001",
        "algorithm.optimizer_options.weight_decay=0.000001", "algorithm.optimizer_options.beta1=0.9",
        "algorithm.optimizer_options.beta2=0.9999", "algorithm.optimizer_options.clip_radius=1.0",
        "algorithm.optimizer_options.hess_approx=price", "algorithm.optimizer_options.rescale_lr=true",
        "algorithm.callbacks.param_noise.variant=c3po", "algorithm.callbacks.param_noise.num_samples=4",
        "algorithm.seq_mask_tau=2.0"]
VP = "algorithm.callbacks.value_prior"
V05 = [f"{VP}.k_init=4", f"{VP}.k_max=16", f"{VP}.cost=0.0039", f"{VP}.min_active_frac=0.25", f"{VP}.pad_to=32",
       f"{VP}.round_size=1", f"{VP}.context_size=256", f"{VP}.min_context=32",
       f"{VP}.backbone=minilm", f"{VP}.head=kernel", f"{VP}.features=auto", f"{VP}.max_length=128"]

# key -> (label, overrides); the group sizes, k and N are the issue's
METHODS: dict[str, tuple[str, list[str]]] = {
    "grpo_g16": ("GRPO (G = 16)", ["algorithm=grpo", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                                   *ADAMW]),
    "grpo_g4": ("GRPO (G = 4)", ["algorithm=grpo", "algorithm.group_size=4", "algorithm.scale_adv_by_std=true",
                                 *ADAMW]),
    "v05": ("V0.5 (k_init = 4, OSLA ≤ 16)", ["algorithm=v05", "algorithm.scale_adv_by_std=false", *ADAMW, *V05]),
    "c3po": ("C3PO (N = 4, G = 16)", ["algorithm=c3po", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                                      *IVON]),
    "c3po_v05": ("C3PO + V0.5 (N = 4, k_init = 4, OSLA ≤ 16)", ["algorithm=c3po_v05",
                                                                "algorithm.scale_adv_by_std=false",
                                                              *IVON, *V05]),
}
ORACLE = "callbacks.oracle"

# the table's figures per run: (key, column header); defined in `run_figures` and in the doc
FIGURES = [
    ("acc_after", "held-out acc after"),
    ("acc_gain", "held-out gain"),
    ("train_acc_tail", "train rollout acc (last 10%)"),
    ("rollouts", "rollouts consumed"),
    ("grad_mean", "grad-norm mean"),
    ("grad_std", "grad-norm sd (over steps)"),
    ("entropy_tail", "entropy (last 10%)"),
    ("equal_frac", "equal-reward groups"),
    ("zero_adv_frac", "zero-advantage groups"),
    ("malformed_frac", "malformed"),
    ("baseline_mse", "baseline MSE vs oracle"),
    ("wall_s", "wall s / run"),
]

# (claim, method, reference, figure, sign): the claim holds when sign·(method − reference) > 0
CLAIMS = [
    ("V0.5 beats GRPO G=16: held-out accuracy", "v05", "grpo_g16", "acc_after", +1),
    ("V0.5 vs GRPO G=16: train rollout accuracy", "v05", "grpo_g16", "train_acc_tail", +1),
    ("V0.5 vs GRPO G=16: fewer rollouts", "v05", "grpo_g16", "rollouts", -1),
    ("V0.5 vs GRPO G=16: lower gradient norm", "v05", "grpo_g16", "grad_mean", -1),
    ("V0.5 vs GRPO G=16: steadier gradient norm (sd)", "v05", "grpo_g16", "grad_std", -1),
    ("V0.5 vs GRPO G=16: higher entropy", "v05", "grpo_g16", "entropy_tail", +1),
    ("V0.5 vs GRPO G=16: lower baseline MSE", "v05", "grpo_g16", "baseline_mse", -1),
    ("V0.5 vs GRPO G=4: lower baseline MSE", "v05", "grpo_g4", "baseline_mse", -1),
    ("V0.5 beats GRPO G=4: held-out accuracy", "v05", "grpo_g4", "acc_after", +1),
    ("V0.5 beats GRPO G=4: train rollout accuracy", "v05", "grpo_g4", "train_acc_tail", +1),
    ("C3PO beats GRPO G=16: held-out accuracy", "c3po", "grpo_g16", "acc_after", +1),
    ("C3PO beats GRPO G=16: train rollout accuracy", "c3po", "grpo_g16", "train_acc_tail", +1),
    ("C3PO vs GRPO G=16: fewer zero-advantage groups", "c3po", "grpo_g16", "zero_adv_frac", -1),
    ("C3PO vs GRPO G=16: fewer malformed rollouts", "c3po", "grpo_g16", "malformed_frac", -1),
    ("C3PO + V0.5 beats C3PO: held-out accuracy", "c3po_v05", "c3po", "acc_after", +1),
]

PANELS = [
    ("reward/accuracy", "Train rollout accuracy (dots = held-out)", "accuracy"),
    ("loss/entropy", "Policy entropy", "nats / token"),
    ("grad/norm", "Gradient norm (before clipping)", "L2 norm"),
    ("groups/zero_adv_frac", "Groups with all rewards equal", "fraction of groups"),
    ("repro/baseline_mse", "Baseline MSE vs oracle (sampled steps)", "MSE (reward scale ±1)"),
    ("reward/malformed_frac", "Malformed rollouts", "fraction"),
]
START, END = "<!-- analysis:start -->", "<!-- analysis:end -->"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run (equal for every method)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per method")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per RL step")
    parser.add_argument("--num-test", type=int, default=512, help="held-out prompts")
    parser.add_argument("--eval-samples", type=int, default=8, help="held-out samples per prompt (mean@k, T = 1)")
    parser.add_argument("--oracle-every", type=int, default=10, help="oracle baseline on every n-th step")
    parser.add_argument("--oracle-samples", type=int, default=32, help="oracle rollouts per prompt")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each gets threads/jobs torch threads)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all")
    parser.add_argument("--out-dir", default="runs/reproduce", help="run directories")
    parser.add_argument("--doc", default="docs/results/reproduction.md", help="markdown report")
    parser.add_argument("--figure", default=None, help="figure path (default: the doc's name with .png)")
    parser.add_argument("--force", action="store_true", help="run again even where a finished run exists")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        parser.error(f"--methods: unknown {unknown}; valid: {', '.join(METHODS)}")
    if min(args.steps, args.seeds, args.batch_size, args.jobs, args.threads) < 1:
        parser.error("--steps, --seeds, --batch-size, --jobs and --threads must be >= 1")
    return args


def overrides(method: str, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """Every override of one run: pinned settings, the method's, the scale, the oracle callback."""
    scale = [f"seed={seed}", f"trainer.max_steps={args.steps}", f"data.batch_size={args.batch_size}",
             f"data.num_test={args.num_test}", f"algorithm.eval_samples={args.eval_samples}"]
    oracle = [f"+{ORACLE}._target_=lit_rlvr.callbacks.oracle_baseline.OracleBaseline",
              f"+{ORACLE}.every_n_steps={args.oracle_every}", f"+{ORACLE}.num_samples={args.oracle_samples}"]
    return [*MODEL, *DATA, *LOOP, *METHODS[method][1], *scale, *oracle, f"hydra.run.dir={run_dir}"]


def run_one(method: str, seed: int, args: argparse.Namespace) -> tuple[Path, bool]:
    """One `python train.py` run; reused when it finished before with the same overrides."""
    run_dir = (Path(args.out_dir) / method / f"seed{seed}").resolve()
    ovr = overrides(method, seed, args, run_dir)
    settings = run_dir / "repro_overrides.json"
    if not args.force and (run_dir / "summary.json").exists() and settings.exists() \
            and json.loads(settings.read_text()) == ovr:
        print(f"[reuse] {method} seed {seed}", flush=True)
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
        tail = (run_dir / "train.log").read_text()[-3000:]
        raise RuntimeError(f"{method} seed {seed} failed (exit {proc.returncode}); "
                           f"log {run_dir / 'train.log'}:\n{tail}")
    print(f"[done] {method} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir, False


# -- reading the runs ---------------------------------------------------------------------------------------------
def load_run(run_dir: Path, oracle_every: int):
    """`report.load_run`, with the oracle's figures kept on the sampled steps only (a run written before the callback
    logged NaN on the other steps has Lightning's repeats of the last sampled value there)."""
    from lit_rlvr import report
    from lit_rlvr.callbacks.oracle_baseline import ORACLE_KEYS

    run = report.load_run(run_dir)
    off = run.train["step"] % oracle_every != 0
    for key in ORACLE_KEYS:
        if key in run.train:
            run.train.loc[off, key] = math.nan
    return run


def run_figures(run_dir: Path, oracle_every: int) -> dict[str, float]:
    """The table's figures of one run, from its metrics.csv and summary.json."""
    from lit_rlvr import report

    run = load_run(run_dir, oracle_every)
    train, summary = run.train, run.summary

    def col(name: str):
        return train[name].dropna() if name in train else train.iloc[:0, 0]

    def mean(name: str) -> float:
        values = col(name)
        return float(values.mean()) if len(values) else math.nan

    grad = col("grad/norm")
    return {
        "steps": int(summary["steps"]),
        "acc_before": float(summary["accuracy_before"]),
        "acc_after": float(summary["accuracy_after"]),
        "acc_gain": float(summary["accuracy_after"]) - float(summary["accuracy_before"]),
        "train_acc_tail": report.tail_mean(train, "reward/accuracy"),
        "rollouts": float(summary["rollouts_total"]),
        "grad_mean": float(grad.mean()),
        "grad_std": float(grad.std(ddof=1)) if len(grad) > 1 else math.nan,
        "entropy_tail": report.tail_mean(train, "loss/entropy"),
        "equal_frac": mean("groups/zero_adv_frac"),
        "zero_adv_frac": mean("repro/all_zero_adv_frac"),
        "malformed_frac": mean("reward/malformed_frac"),
        "baseline_mse": mean("repro/baseline_mse"),
        "group_mean_mse": mean("repro/group_mean_mse"),
        "oracle_steps": int(col("repro/baseline_mse").size),
        "wall_s": float(summary["wall_s"]),
    }


def mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def fmt(value: float, digits: int) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def fmt_pm(values: list[float], digits: int) -> str:
    m, sd = mean_sd(values)
    return fmt(m, digits) if math.isnan(sd) else f"{fmt(m, digits)} ± {fmt(sd, digits)}"


DIGITS = {"rollouts": 0, "wall_s": 0, "baseline_mse": 4, "malformed_frac": 4}


def results_table(per_run: dict[str, list[dict[str, float]]]) -> str:
    head = ["method", "seeds", *[h for _, h in FIGURES]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in per_run.items():
        cells = [METHODS[method][0], str(len(runs))]
        cells += [fmt_pm([r[key] for r in runs], DIGITS.get(key, 3)) for key, _ in FIGURES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdict(diffs: list[float], sign: int) -> str:
    """`supported` when every seed shows the claimed direction and |mean| ≥ 2·sd/√n (a t of at least 2);
    `contradicted` when the same holds for the opposite direction; else `not resolved`."""
    n = len(diffs)
    if n < 2:
        return "not resolved (one seed)"
    m, sd = mean_sd(diffs)
    strong = abs(m) >= 2 * sd / math.sqrt(n) if sd > 0 else m != 0
    if strong and all(sign * d > 0 for d in diffs):
        return "supported"
    if strong and all(sign * d < 0 for d in diffs):
        return "contradicted"
    return "not resolved"


def claims_table(per_run: dict[str, list[dict[str, float]]]) -> str:
    head = ["claim", "figure", "method − reference, per seed", "mean ± sd", "seeds in the claimed direction", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for claim, method, ref, key, sign in CLAIMS:
        if method not in per_run or ref not in per_run:
            continue
        pairs = list(zip(per_run[method], per_run[ref]))  # same seed: same data order and held-out set
        diffs = [a[key] - b[key] for a, b in pairs]
        digits = DIGITS.get(key, 3)
        agree = sum(sign * d > 0 for d in diffs)
        cells = [claim, key, ", ".join(f"{d:+.{digits}f}" for d in diffs), fmt_pm(diffs, digits),
                 f"{agree}/{len(diffs)}", verdict(diffs, sign)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- figure ----------------------------------------------------------------------------------------------------------
def mean_run(method: str, run_dirs: list[Path], oracle_every: int):
    """A `report.Run` whose rows are the step-wise means over the seeds' runs."""
    import pandas as pd

    from lit_rlvr import report

    runs = [load_run(d, oracle_every) for d in run_dirs]
    train = pd.concat([r.train for r in runs]).groupby("step", as_index=False).mean(numeric_only=True)
    val = pd.concat([r.val for r in runs]).groupby("step", as_index=False).mean(numeric_only=True)
    label = f"{METHODS[method][0]} — mean of {len(runs)} seed{'s' if len(runs) > 1 else ''}"
    return report.Run(run_dirs[0].parent, label, train, val, {})


def draw_figure(dirs: dict[str, list[Path]], out: Path, oracle_every: int) -> None:
    from lit_rlvr import report

    runs = [mean_run(method, paths, oracle_every) for method, paths in dirs.items()]
    report.plot(runs, out, panels=PANELS, title="lit-rlvr reproduction on the built-in task", dpi=60)
    from PIL import Image  # matplotlib's own dependency

    Image.open(out).convert("RGB").quantize(colors=128).save(out, optimize=True)  # a committed figure: keep it small


# -- the doc ---------------------------------------------------------------------------------------------------------
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
    records = json.loads(path.read_text()) if path.exists() else []
    records.append({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": info["argv"], "commit": info["commit"],
                    "wall_s": round(info["wall_s"], 1), "runs_trained": info["runs_done"],
                    "runs_reused": info["runs_reused"], "load_start": info["load_start"], "load_end": info["load_end"]})
    path.write_text(json.dumps(records, indent=1))
    return records


def timing_lines(info: dict[str, Any]) -> str:
    records = info["invocations"]
    training = [r for r in records if r["runs_trained"] > 0]
    total = sum(r["wall_s"] for r in training)
    lines = [f"* wall time of the command, over the invocation(s) that trained runs: **{total / 60:.1f} min**; the sum "
             f"of the runs' own wall times (model load, held-out evaluations and training, without process start) is "
             f"{info['sum_run_s'] / 60:.1f} min"]
    for r in records:
        lines.append(f"  * {r['when']}: {r['wall_s'] / 60:.1f} min, {r['runs_trained']} runs trained, "
                     f"{r['runs_reused']} "
                     f"reused (commit {r['commit']}; load average {r['load_start']} → {r['load_end']})"
                     + (f"; {r['note']}" if r.get("note") else ""))
    return "\n".join(lines)


def kept_analysis(doc: Path) -> str:
    if doc.exists():
        text = doc.read_text()
        if START in text and END in text:
            return text.split(START, 1)[1].split(END, 1)[0].strip("\n")
    return "_(not written yet: read the tables and the figure, then write what they support here)_"


def write_doc(args, per_run, figure: Path, doc: Path, info: dict[str, Any]) -> None:
    nice = f"nice -n {info['nice']} " if info["nice"] else ""
    command = f"{nice}python scripts/reproduce.py" + ("" if not info["argv"] else " " + shlex.join(info["argv"]))
    settings = ", ".join(f"`{o}`" for o in [*MODEL, *DATA])
    fig_rel = os.path.relpath(figure, doc.parent)
    text = f"""# Reproducing the papers' claims at small scale

Generated by `scripts/reproduce.py` (the tables, command, machine and timing; the analysis section is written by
hand and kept when the script writes this file again).

## Command, machine, time

```bash
{command}
```

* commit `{info['commit']}`; {info['machine']['cpu']}, {info['machine']['cores']} cores, Python
{info['machine']['python']}, torch {info['machine']['torch']}
* {args.jobs} runs at once, {max(1, args.threads // args.jobs)} torch thread(s) each
{timing_lines(info)}

## Setup

Every run is `python train.py` with the same pinned settings: {settings}; {args.steps} optimizer steps (one per RL
step) of {args.batch_size} prompts; ≤ 8 new tokens, temperature 1.0, no KL, no entropy bonus; held-out: {args.num_test}
test prompts × {args.eval_samples} samples at temperature 1.0 (mean@{args.eval_samples}), before and after training.
GRPO-family runs: AdamW, lr 3e-4, grad clip 1.0. C3PO runs: the tiny IVON preset of `conf/algorithm/c3po.yaml`
(λ = 1e8, lr 0.03, clip radius 1, N = 4, τ = 2). V0.5: `conf/algorithm/callbacks/value_prior.yaml` (k_init 4,
k_max 16, c = 0.0039, pad to 32, 25% rule, MiniLM backbone + kernel head, context 256, prior from 32 records on).
Seeds 0..{args.seeds - 1}: a seed fixes the data order and the sampling, the same for every method; the held-out
split is fixed (`data.split_seed=0`, the tiny model's warm-up split), so every seed scores the same held-out prompts.
Every override is in each run's `repro_overrides.json`; `scripts/reproduce.py` lists them.

Figures per run: held-out accuracy = `val/accuracy` after training (gain = after − before); train rollout acc =
accuracy of the training rollouts over the last 10% of steps; rollouts consumed = `rollouts_total` (the oracle's
extra rollouts are not counted); gradient norm before clipping, mean and sd over the steps; entropy = token
entropy of the policy on its rollouts, last 10% of steps; equal-reward groups = `groups/zero_adv_frac` (all rewards
of a prompt equal); zero-advantage groups = prompts whose advantages are all zero (`repro/all_zero_adv_frac`: the same
for GRPO and C3PO, but V0.5's fused baseline gives an equal-reward group a nonzero advantage); malformed = fraction
of rollouts without a readable answer; baseline MSE = mean over the sampled steps (every {args.oracle_every}th) of
mean over prompts (b − μ)², where b is the baseline the method's advantages used (group mean, or V0.5's fused
baseline) and μ the expected reward of the same prompts under the same weights, estimated by {args.oracle_samples}
extra rollouts per prompt (C3PO: spread over the same N weight samples) and debiased for the oracle's own noise
(`callbacks/oracle_baseline.py`).

## Results (mean ± sd over seeds)

{results_table(per_run)}
## The claims, seed by seed

Differences are paired by seed. Verdict rule: *supported* when every seed shows the claimed direction and
|mean| ≥ 2·sd/√n; *contradicted* when the same holds the other way; otherwise *not resolved*.

{claims_table(per_run)}
![reproduction]({fig_rel})

## What this supports, and what it does not

{START}
{kept_analysis(doc)}
{END}
"""
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started, load_start = time.perf_counter(), " ".join(f"{x:.1f}" for x in os.getloadavg())
    jobs = [(m, s) for s in range(args.seeds) for m in args.methods]  # seed-major: early seeds finish first
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(lambda job: run_one(*job, args), jobs))
    dirs_flat = [d for d, _ in done]
    dirs: dict[str, list[Path]] = {m: [d for (mm, _), d in zip(jobs, dirs_flat) if mm == m] for m in args.methods}
    per_run = {m: [run_figures(d, args.oracle_every) for d in paths] for m, paths in dirs.items()}
    for m, runs in per_run.items():
        bad = [r["steps"] for r in runs if r["steps"] != args.steps]
        if bad:
            raise RuntimeError(f"{m}: runs made {bad} steps, not {args.steps} (equal optimizer steps is the point)")
    doc = Path(args.doc)
    figure = Path(args.figure) if args.figure else doc.with_suffix(".png")
    draw_figure(dirs, figure, args.oracle_every)
    reused = sum(r for _, r in done)
    info = {"argv": argv, "nice": os.nice(0), "commit": git_commit(), "machine": machine(), "load_start": load_start,
            "load_end": " ".join(f"{x:.1f}" for x in os.getloadavg()), "wall_s": time.perf_counter() - started,
            "runs_done": len(jobs) - reused, "runs_reused": reused,
            "sum_run_s": sum(r["wall_s"] for runs in per_run.values() for r in runs)}
    info["invocations"] = record_invocation(Path(args.out_dir), info)
    write_doc(args, per_run, figure, doc, info)
    raw = {"settings": vars(args), "info": info,
           "runs": {m: [{"seed": s, **r} for s, r in enumerate(runs)] for m, runs in per_run.items()}}
    doc.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str))
    print(results_table(per_run))
    print(claims_table(per_run))
    print(f"doc: {doc}\nfigure: {figure}\nwall: {info['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
