"""Compare runs: one figure and a markdown table of final figures.

    python -m lit_rlvr.run.report RUN_DIR [RUN_DIR ...] --out report.png     (also writes report.md)
    python -m lit_rlvr.run.report runs/grpo_s* runs/c3po_s* --group          (seeds of a method: mean ± sd band)

A run dir holds `metrics.csv` (train.py, or the CLI's CSVLogger dir) and, for train.py runs, `summary.json`.
Each metric is drawn twice: against the RL step and against the rollouts consumed (`rollouts/total`), the
fair axis when methods spend different numbers of rollouts per step (DAPO refills, V0.5, C3PO).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lit_rlvr.config.extras import require

pd = require("pandas")

# (column, panel title, y label); the first is the accuracy panel, which also shows validation points
PANELS = [
    ("reward/accuracy", "Accuracy (all rollouts; dots = held-out val)", "accuracy"),
    ("reward/mean", "Mean reward (all rollouts)", "reward"),
    ("loss/entropy", "Policy entropy", "nats / token"),
    ("grad/norm", "Gradient norm (before clipping)", "L2 norm"),
    ("groups/zero_adv_frac", "Zero-advantage groups", "fraction of groups"),
    ("rollouts/per_step", "Rollouts generated per step", "rollouts"),
]
VAL = "val/accuracy"
IN_FIT_STEPS = "val/rl_steps"  # logged by a validation inside fit: the RL updates the evaluated policy has had
# a run that trains on a subset of what it generated (DAPO drops constant groups) also logs `<name>_generated`
# over all its rollouts; panels and table prefer those, so filtering does not flatter a method
GENERATED = ("reward/accuracy", "reward/mean")


@dataclass
class Run:
    path: Path
    label: str
    train: pd.DataFrame  # one row per RL step: step, rollouts/total, metrics
    val: pd.DataFrame  # validation rows: step, val/*, rollouts (consumed before that validation)
    summary: dict = field(default_factory=dict)


def find_metrics(run_dir: Path) -> Path:
    direct = run_dir / "metrics.csv"
    if direct.exists():
        return direct
    found = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"{run_dir}: no metrics.csv (is it a train.py run dir or a CSVLogger dir?)")
    return found[-1]


def read_metrics(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train rows, validation rows) of a Lightning metrics.csv, whose rows are sparse: each logging call
    writes its own row, validation rows carry only val/* and step, columns differ from run to run."""
    frame = pd.read_csv(path).apply(pd.to_numeric, errors="coerce")
    if "step" not in frame:
        raise ValueError(f"{path}: no 'step' column; not a Lightning CSVLogger file")
    train_cols = [c for c in frame.columns if c not in ("epoch", "step") and not c.startswith("val/")]
    train = frame[frame[train_cols].notna().any(axis=1)] if train_cols else frame.iloc[:0]
    train = train.groupby("step", as_index=False).last().sort_values("step")  # rows split by logging calls
    for name in GENERATED:
        if f"{name}_generated" in train:
            train[name] = train[f"{name}_generated"].fillna(train.get(name))
    val_cols = [c for c in frame.columns if c.startswith("val/")]
    val = frame[frame[val_cols].notna().any(axis=1)][["step", *val_cols]] if val_cols else frame.iloc[:0][["step"]]
    val = val.copy()
    if IN_FIT_STEPS in val:
        # a validation inside fit (trainer.val_check_interval) is logged one step before the updates its policy had;
        # the module says how many (and the rollouts consumed by then)
        in_fit = val[IN_FIT_STEPS].notna()
        val.loc[in_fit, "step"] = val.loc[in_fit, IN_FIT_STEPS].astype(int)
    if "rollouts/total" in train and len(val):
        # a validation at step S (after the column above) sees the policy after S updates: after train rows 0..S-1
        totals = dict(zip(train["step"] + 1, train["rollouts/total"]))
        val["rollouts"] = [0.0 if s == 0 else totals.get(s, math.nan) for s in val["step"]]
    return train.reset_index(drop=True), val.reset_index(drop=True)


def load_run(run_dir: str | Path) -> Run:
    path = Path(run_dir)
    train, val = read_metrics(find_metrics(path))
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
    algorithm = summary.get("algorithm") or _cli_model_name(path)
    label = f"{algorithm} · {path.resolve().name}" if algorithm else path.resolve().name
    return Run(path, label, train, val, summary)


def _cli_model_name(path: Path) -> Optional[str]:
    """The model class of a `lit-rlvr` run (its config.yaml), as the algorithm name."""
    config = path / "config.yaml"
    if not config.exists():
        return None
    for line in config.read_text().splitlines():
        if line.strip().startswith("class_path:") and "Module" in line:
            return line.split(":", 1)[1].strip().rsplit(".", 1)[-1]
    return None


def smooth(values: pd.Series) -> pd.Series:
    """Trailing moving average over ~1/15 of the run, at least 3 points (a short run is smoothed too)."""
    window = max(3, len(values) // 15)
    return values.rolling(window, min_periods=1).mean()


SD = "_sd"  # a grouped run's frames hold `<column>_sd` beside each mean column


def group_runs(runs: list[Run]) -> list[Run]:
    """Runs of one algorithm (summary.json's, else the label) merged into one: each metric's mean and sd over
    the runs at each step (steps some runs lack use the runs that have them), labelled with the run count."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.summary.get("algorithm") or run.label, []).append(run)
    return [_merge(name, members) if len(members) > 1 else members[0] for name, members in groups.items()]


def _merge(name: str, runs: list[Run]) -> Run:
    def stats(frames: list[pd.DataFrame]) -> pd.DataFrame:
        stacked = pd.concat(frames).groupby("step")
        mean, sd = stacked.mean(), stacked.std(ddof=1 if len(frames) > 1 else 0)
        return mean.join(sd.add_suffix(SD)).reset_index()

    summary = {"algorithm": name}
    for key in ("accuracy_before", "accuracy_after", "wall_s"):
        values = [r.summary[key] for r in runs if isinstance(r.summary.get(key), (int, float))]
        summary[key] = sum(values) / len(values) if values else math.nan
    val = stats([r.val for r in runs]) if all(len(r.val) for r in runs) else runs[0].val.iloc[:0]
    return Run(runs[0].path, f"{name} · mean ± sd of {len(runs)} runs", stats([r.train for r in runs]), val, summary)


def tail_mean(frame: pd.DataFrame, column: str) -> float:
    """Mean over the last 10% of the steps (at least one): the run's final level, less noisy than one step."""
    if column not in frame or frame[column].notna().sum() == 0:
        return math.nan
    values = frame[column].dropna()
    return float(values.iloc[-max(1, len(values) // 10):].mean())


def plot(runs: list[Run], out: Path, *, panels: Optional[list[tuple[str, str, str]]] = None,
         title: str = "lit-rlvr run comparison", dpi: int = 110) -> None:
    """Six panels (default `PANELS`; the first is the accuracy panel), each against steps and rollouts."""
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig, axes = plt.subplots(3, 4, figsize=(22, 12.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (column, name, ylabel) in enumerate(panels or PANELS):
        for side, (xcol, xlabel) in enumerate([("step", "RL step"), ("rollouts/total", "rollouts consumed")]):
            ax = axes[index // 2, (index % 2) * 2 + side]
            for k, run in enumerate(runs):
                _draw(ax, run, column, xcol, colors[k % len(colors)], is_accuracy=index == 0)
            ax.set_title(f"{name} — vs {xlabel}", fontsize=11)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 90k, 105k: tick labels that do not run together
            if column in ("reward/accuracy", "groups/zero_adv_frac", "repro/all_zero_adv_frac"):
                ax.set_ylim(-0.03, 1.03)
    handles = [plt.Line2D([], [], color=colors[k % len(colors)], lw=2.5, label=run.label) for k, run in enumerate(runs)]
    fig.suptitle(f"{title} (thin line = per step, thick = moving average)", fontsize=14)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(runs), 4), fontsize=12, frameon=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def _draw(ax, run: Run, column: str, xcol: str, color: str, *, is_accuracy: bool) -> None:
    frame = run.train
    if column in frame and xcol in frame and frame[column].notna().any():
        data = frame[[xcol, column]].dropna()
        ax.plot(data[xcol], data[column], color=color, alpha=0.3, lw=1)
        ax.plot(data[xcol], smooth(data[column]), color=color, lw=2.2)
        if column + SD in frame:  # a group of runs: ± one sd around the mean
            band = frame[[xcol, column, column + SD]].dropna()
            ax.fill_between(band[xcol], band[column] - band[column + SD], band[column] + band[column + SD],
                            color=color, alpha=0.15, lw=0)
    if is_accuracy and VAL in run.val and len(run.val):
        vx = run.val["step"] if xcol == "step" else run.val.get("rollouts")
        if vx is not None:
            ax.plot(vx, run.val[VAL], color=color, ls="--", marker="o", ms=7, lw=1)


def table(runs: list[Run]) -> str:
    """Markdown table of each run's final figures."""
    head = ["run", "steps", "rollouts", "rollout acc (last 10%)", "rollout reward (last 10%)", "val acc before → after",
            "entropy (last 10%)", "grad norm (last 10%)", "zero-adv groups (mean)", "rollouts/step (mean)", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        train, val, summary = run.train, run.val, run.summary
        steps = int(train["step"].max()) + 1 if len(train) else 0
        rollouts = train["rollouts/total"].max() if "rollouts/total" in train else math.nan
        before = summary.get("accuracy_before", val[VAL].iloc[0] if VAL in val and len(val) > 1 else math.nan)
        after = summary.get("accuracy_after", val[VAL].iloc[-1] if VAL in val and len(val) else math.nan)
        mean = lambda c: float(train[c].mean()) if c in train else math.nan  # noqa: E731
        cells = [run.label, str(steps), _fmt(rollouts, 0), _fmt(tail_mean(train, "reward/accuracy")),
                 _fmt(tail_mean(train, "reward/mean")), f"{_fmt(before)} → {_fmt(after)}",
                 _fmt(tail_mean(train, "loss/entropy")), _fmt(tail_mean(train, "grad/norm")),
                 _fmt(mean("groups/zero_adv_frac")), _fmt(mean("rollouts/per_step"), 1), _fmt(summary.get("wall_s"), 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{float(value):.{digits}f}"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_rlvr.run.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.csv)")
    parser.add_argument("--out", default="report.png", help="figure path; the table goes next to it as .md")
    parser.add_argument("--group", action="store_true",
                        help="draw the runs of one algorithm (e.g. seeds) as their mean with a ± sd band")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(r) for r in args.runs]
    except FileNotFoundError as err:  # a path that is not a run dir: its line, not a traceback
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if args.group:
        runs = group_runs(runs)
    out = Path(args.out)
    plot(runs, out)
    text = table(runs)
    out.with_suffix(".md").write_text(f"# lit-rlvr run comparison\n\n![runs]({out.name})\n\n{text}")
    print(text, end="")
    print(f"figure: {out}\ntable: {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
