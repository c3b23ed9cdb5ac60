"""The tables, verdicts, figures and the markdown doc of `scripts/reproduce.py` (from per-run figures)."""

from __future__ import annotations

import math
import os
import shlex
import statistics
from pathlib import Path
from typing import Any

from reproduce_settings import CLAIMS, DIGITS, EQUAL_ROLLOUTS, EXPLORATION_FIGURES, FIGURES, LABELS, Task

START, END = "<!-- analysis:start -->", "<!-- analysis:end -->"
Runs = dict[str, list[dict[str, Any]]]  # method -> one figures dict per seed (seed order)


def mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def fmt(value: float, digits: int) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def fmt_pm(values: list[float], digits: int) -> str:
    m, sd = mean_sd(values)
    return fmt(m, digits) if math.isnan(sd) else f"{fmt(m, digits)} ± {fmt(sd, digits)}"


def results_table(per_run: Runs, figures: list[tuple[str, str]] = FIGURES) -> str:
    head = ["method", "seeds", *[h for _, h in figures]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in per_run.items():
        cells = [LABELS[method], str(len(runs))]
        cells += [fmt_pm([r.get(key, math.nan) for r in runs], DIGITS.get(key, 3)) for key, _ in figures]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def has_exploration_figures(per_run: Runs) -> bool:
    """Whether a run logged the 3PO study's figures (IVON's noise, or the dead-group probe)."""
    return any(not math.isnan(r.get(key, math.nan)) for runs in per_run.values() for r in runs
               for key, _ in EXPLORATION_FIGURES if key != "weight_change")


def exploration_table(per_run: Runs) -> str:
    """The 3PO study's figures per method (empty when no run has them)."""
    if not has_exploration_figures(per_run):
        return ""
    return ("\n### Exploration: noise, movement, dead groups (mean ± sd over seeds)\n\n"
            + results_table(per_run, EXPLORATION_FIGURES) + "\n" + EXPLORATION_TEXT + "\n")


EXPLORATION_TEXT = """Noise / weights = RMS of the loss sample's perturbation θ̂ − m over the RMS of the weights m
(`noise/relative`, mean over steps); relative weight change = ‖θ − θ₀‖ / ‖θ₀‖ of the last checkpoint (IVON: its mean)
against the warm-up (`scripts/weight_change.py`). Dead groups (`callbacks/dead_groups.py`, on every 10th step before
the update, rows of the probed methods only): the share of the step's prompts whose G = 16 completions at the mean
weights are all wrong; of those, the share where another G completions find at least one correct answer: a second
draw at the mean (what chance alone rescues), G/N from each of the step's N IVON weight samples (C3PO's exploration),
or the mean at temperature 1.5 (the action-space alternative); malformed = share of that arm's completions without
a readable answer. None of the probe's completions is trained on or counted as a rollout."""


def verdict(diffs: list[float], sign: int) -> str:
    """`supported` when every seed shows the claimed direction and |mean| ≥ 2·sd/√n (a t of at least 2);
    `contradicted` when the same holds for the opposite direction; else `not resolved`."""
    n = len(diffs)
    if n < 2:
        return "not resolved (one seed)"
    m, sd = mean_sd(diffs)
    if math.isnan(m):
        return "not resolved (no data)"
    strong = abs(m) >= 2 * sd / math.sqrt(n) if sd > 0 else m != 0
    if strong and all(sign * d > 0 for d in diffs):
        return "supported"
    if strong and all(sign * d < 0 for d in diffs):
        return "contradicted"
    return "not resolved"


def interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Linear interpolation of the curve (xs increasing) at x; NaN outside it."""
    if not xs or x < xs[0] or x > xs[-1]:
        return math.nan
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def paired_figure(key: str, run: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    """(method's value, reference's value) of one seed. `acc_at_equal_rollouts`: each held-out accuracy curve
    (against rollouts consumed) read at the smaller of the two runs' rollout totals, so the run that spent more
    is judged at the point where it had spent what the other spent in all."""
    if key != EQUAL_ROLLOUTS:
        return run[key], ref[key]
    budget = min(run["rollouts"], ref["rollouts"])
    read = lambda r: interp(budget, [p["rollouts"] for p in r["curve"]], [p["acc"] for p in r["curve"]])  # noqa: E731
    return read(run), read(ref)


def claims_table(per_run: Runs) -> str:
    head = ["claim", "figure", "method − reference, per seed", "mean ± sd", "seeds in the claimed direction", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for claim, method, ref, key, sign in CLAIMS:
        if method not in per_run or ref not in per_run:
            continue
        # paired by seed (a run's "seed"; its position where it has none): only the seeds both methods have
        ref_by_seed = {r.get("seed", i): r for i, r in enumerate(per_run[ref])}
        pairs = [paired_figure(key, a, ref_by_seed[a.get("seed", i)]) for i, a in enumerate(per_run[method])
                 if a.get("seed", i) in ref_by_seed]
        if not pairs:
            continue
        diffs = [a - b for a, b in pairs]
        digits = DIGITS.get(key, 3)
        agree = sum(sign * d > 0 for d in diffs)
        cells = [claim, key, ", ".join(f"{d:+.{digits}f}" for d in diffs), fmt_pm(diffs, digits),
                 f"{agree}/{len(diffs)}", verdict(diffs, sign)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- figures ---------------------------------------------------------------------------------------------------------
def exploration_figure(per_run: Runs, ess: dict[str, float], out: Path, title: str) -> None:
    """Two panels: held-out accuracy after training against λ (the runs named in `ess`, mean ± sd over seeds, log
    axis), and the
    dead-group probe's rescued shares per probed method (mean ± sd over seeds)."""
    from lit_rlvr.config.extras import require

    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), constrained_layout=True)
    sweep = sorted((lam, method) for method, lam in ess.items() if method in per_run)
    for key, label in (("acc_after", "held-out mean@k after"), ("pass_after", "held-out pass@k after")):
        stats = [mean_sd([r[key] for r in per_run[m]]) for _, m in sweep]
        left.errorbar([lam for lam, _ in sweep], [m for m, _ in stats], yerr=[0 if math.isnan(sd) else sd
                                                                              for _, sd in stats],
                      marker="o", capsize=4, label=label)
    before = mean_sd([r["acc_before"] for _, m in sweep for r in per_run[m]])[0]
    left.axhline(before, color="grey", linestyle="--", label="held-out mean@k before")
    left.set_xscale("log")
    left.set_xlabel("λ (IVON's effective sample size): small = more weight noise")
    left.set_title("C3PO against its noise scale")
    left.legend()
    arms = [("rescued_again", "second draw (chance)"), ("rescued_weights", "N weight samples"),
            ("rescued_hot", "T = 1.5")]
    probed = [m for m, runs in per_run.items() if any(not math.isnan(r.get("rescued_again", math.nan)) for r in runs)]
    width = 0.8 / max(len(arms), 1)
    for i, (key, label) in enumerate(arms):
        stats = [mean_sd([r.get(key, math.nan) for r in per_run[m]]) for m in probed]
        right.bar([j + i * width for j in range(len(probed))], [m for m, _ in stats], width,
                  yerr=[0 if math.isnan(sd) else sd for _, sd in stats], capsize=3, label=label)
    right.set_xticks([j + width for j in range(len(probed))], [LABELS[m] for m in probed], fontsize=8)
    right.set_ylabel("share of dead groups rescued")
    right.set_title("Dead groups (all G wrong at the mean): what rescues them")
    right.legend()
    fig.suptitle(f"lit-rlvr 3PO study on {title}")
    fig.savefig(out, dpi=60)
    plt.close(fig)
    _shrink(out)



def passk_table(per_run: Runs) -> str:
    """Held-out pass@k after training against k (mean ± sd over seeds); empty when no run has a ladder."""
    ks = sorted({k for runs in per_run.values() for r in runs for k in r.get("pass_ladder", {})})
    if len(ks) < 2:
        return ""
    head = ["method", "seeds", *[f"pass@{k}" for k in ks]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in per_run.items():
        cells = [fmt_pm([r.get("pass_ladder", {}).get(k, math.nan) for r in runs], 3) for k in ks]
        lines.append("| " + " | ".join([LABELS[method], str(len(runs)), *cells]) + " |")
    return "\n### Held-out pass@k after training, against k\n\n" + "\n".join(lines) + "\n"


def passk_figure(per_run: Runs, out: Path, title: str) -> None:
    """Held-out pass@k after training against k (log axis), mean ± sd over seeds per method."""
    from lit_rlvr.config.extras import require

    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6), constrained_layout=True)
    for method, runs in per_run.items():
        ks = sorted({k for r in runs for k in r.get("pass_ladder", {})})
        stats = [mean_sd([r.get("pass_ladder", {}).get(k, math.nan) for r in runs]) for k in ks]
        ax.errorbar(ks, [m for m, _ in stats], yerr=[0 if math.isnan(sd) else sd for _, sd in stats], marker="o",
                    capsize=3, label=f"{LABELS[method]} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (held-out samples per prompt)")
    ax.set_ylabel("held-out pass@k after training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"lit-rlvr rivals study on {title}: pass@k against k")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=60)
    plt.close(fig)
    _shrink(out)


def heldout_figure(per_run: Runs, out: Path, title: str, eval_samples: int) -> None:
    """Held-out mean@k and pass@k against RL steps and against rollouts consumed: each method's mean over its
    seeds with a ± one sd band (the evaluations are at the same steps in every seed; the rollout axis is the
    seeds' mean rollouts at that step)."""
    from lit_rlvr.config.extras import require

    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 10), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (method, runs) in enumerate(per_run.items()):
        steps = sorted(set.intersection(*[{p["step"] for p in r["curve"]} for r in runs]))
        for row, (metric, name) in enumerate([("acc", f"held-out mean@{eval_samples}"),
                                              ("pass", f"held-out pass@{eval_samples}")]):
            values = [[next(p[metric] for p in r["curve"] if p["step"] == s) for r in runs] for s in steps]
            rollouts = [statistics.fmean(next(p["rollouts"] for p in r["curve"] if p["step"] == s) for r in runs)
                        for s in steps]
            mean = [mean_sd(v)[0] for v in values]
            sd = [0.0 if len(v) < 2 else mean_sd(v)[1] for v in values]
            for col, (xs, xlabel) in enumerate([(steps, "RL step"), (rollouts, "rollouts consumed")]):
                ax = axes[row, col]
                ax.plot(xs, mean, color=colors[k % len(colors)], marker="o", ms=4, lw=2, label=LABELS[method])
                ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                                color=colors[k % len(colors)], alpha=0.15, lw=0)
                ax.set_title(f"{name} vs {xlabel}")
                ax.set_xlabel(xlabel)
                ax.set_ylabel(name)
                ax.grid(alpha=0.3)
    seeds = max(len(r) for r in per_run.values())
    fig.suptitle(f"Held-out accuracy on {title}: mean of {seeds} seed(s), band = ± 1 sd over seeds", fontsize=13)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=70)
    plt.close(fig)
    _shrink(out)


def _shrink(path: Path) -> None:
    from PIL import Image  # matplotlib's own dependency

    Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)  # a committed figure: keep it small


# -- the doc ---------------------------------------------------------------------------------------------------------
def timing_lines(info: dict[str, Any]) -> str:
    records = info["invocations"]
    training = [r for r in records if r["runs_trained"] > 0]
    total = sum(r["wall_s"] for r in training)
    lines = [f"* wall time of the command, over the invocation(s) that trained runs: **{total / 60:.1f} min**; the sum "
             f"of the runs' own wall times (model load, held-out evaluations and training, without process start) is "
             f"{info['sum_run_s'] / 60:.1f} min"]
    for r in records:
        lines.append(f"  * {r['when']}: {r['wall_s'] / 60:.1f} min, {r['runs_trained']} runs trained, "
                     f"{r['runs_reused']} reused (commit {r['commit']}; load average {r['load_start']} → "
                     f"{r['load_end']})" + (f"; {r['note']}" if r.get("note") else ""))
    return "\n".join(lines)


def kept_analysis(doc: Path) -> str:
    if doc.exists():
        text = doc.read_text()
        if START in text and END in text:
            return text.split(START, 1)[1].split(END, 1)[0].strip("\n")
    return "_(not written yet: read the tables and the figures, then write what they support here)_"


def setup_text(args, task: Task) -> str:
    settings = ", ".join(f"`{o}`" for o in [*task.model, *task.data])
    during = (f", and every {args.eval_every} steps during training (the curves)" if args.eval_every else "")
    return f"""Every run is `python train.py` with the same pinned settings ({task.setup}): {settings}; {args.steps}
optimizer steps (one per RL step) of {args.batch_size} prompts; temperature 1.0, no KL, no entropy bonus; held-out:
{args.num_test} test prompts × {args.eval_samples} samples at temperature 1.0 (mean@{args.eval_samples} and
pass@{args.eval_samples}), before and after training{during}.
GRPO-family runs: AdamW, lr {task.grpo_lr:g}, grad clip 1.0. C3PO runs: IVON with the tiny preset of
`conf/algorithm/c3po.yaml` (λ = 1e8, h0 = 1e-3, clip radius 1, N = 4, τ = 2) at lr {task.ivon_lr:g}. V0.5:
`conf/algorithm/callbacks/value_prior.yaml` (k_init 4, k_max 16, c = 0.0039, pad to 32, 25% rule, MiniLM backbone +
kernel head, context 256, prior from 32 records on). LoRA rows: rank 8, alpha 32, every linear layer; the adapters'
lr is GRPO's × 10 (`model.lora.lr_scale=10`, docs/lora.md) and C3PO's × {task.c3po_lora_lr_scale:g}.
Seeds 0..{args.seeds - 1}: a seed fixes the data order and the sampling, the same for every method; the held-out
split is fixed (`data.split_seed=0`, the warm-up's split), so every seed scores the same held-out prompts.
Every override is in each run's `repro_overrides.json`; `scripts/reproduce_settings.py` lists them."""


FIGURES_TEXT = """Figures per run: held-out mean@k = `val/accuracy` after training (gain = after − before), pass@k
the unbiased pass@k
over the same k samples; train rollout acc = accuracy of the training rollouts over the last 10% of steps; rollouts
consumed = `rollouts_total`, tokens generated = `tokens_generated` (the oracle's extra rollouts and the evaluations
are not counted); gradient norm before clipping, mean and sd over the steps; entropy = token entropy of the policy
on its rollouts, last 10% of steps; equal-reward groups = `groups/zero_adv_frac` (all rewards of a prompt equal);
zero-advantage groups = prompts whose advantages are all zero (`repro/all_zero_adv_frac`: the same for GRPO and
C3PO, but V0.5's fused baseline gives an equal-reward group a nonzero advantage); malformed = fraction of rollouts
without a readable answer; {mse}; completion length = mean tokens of the training completions and truncated = the
share cut at the token budget, both over the last 10% of steps. `acc_at_equal_rollouts` (a claim's figure): each
run's held-out curve against rollouts consumed, read (linearly between evaluations) at the smaller of the two runs'
rollout totals."""

MSE_TEXT = """baseline MSE = mean over the sampled steps (every {every}th) of
mean over prompts (b − μ)², where b is the baseline the method's advantages used (group mean, or V0.5's fused
baseline) and μ the expected reward of the same prompts under the same weights, estimated by {samples} extra
rollouts per prompt (C3PO: spread over the same N weight samples) and debiased for the oracle's own noise
(`callbacks/oracle_baseline.py`)"""
NO_MSE_TEXT = "baseline MSE and zero-advantage groups: not measured (`--oracle-every 0`: the oracle did not run)"


TITLES = {"claims": "Reproducing the papers' claims at small scale", "3po": "3PO tested fairly: noise scale, "
          "exploration against the optimizer, dead groups and N",
          "rivals": "V0.5 and 3PO against their cheapest rivals: DBB, allocation at equal rollouts, boundary gating"}
STUDY_SETUP = {"rivals": """The rivals study trains every method on the same fixed set of 320 training prompts
(`data.num_train=320`: 50 steps of 32 prompts are 5 passes), so that the methods that read a prompt's own history
see it again: DBB (`algorithm.advantages=dbb`, discounted Beta–Bernoulli baseline and std, γ = 0.9, Beta(1, 1), G = 8:
256 rollouts a step, near V0.5's), boundary gating (`algorithm.boundary_gating=true`: a prompt with a success observed
in an earlier step gives no policy gradient), and V0.5 with its OSLA allocation replaced by a fixed mean of 9 rollouts
per prompt (`allocation=uniform`, or `allocation=beta`: the Beta posterior of the prompt's history and first round,
extra samples in proportion to √(p̂(1 − p̂))). C3PO here runs at λ = 1e10, the 3PO study's best (lr 0.3). Held-out:
16 samples per prompt, so mean@16 (the same expectation as mean@4, with less noise) and pass@k for k = 1…16 from one
evaluation. The rules of DBB and of the gate are our reading of their papers (docs/algorithms.md)."""}


def write_doc(args, task: Task, per_run: Runs, figures: list[Path], doc: Path, info: dict[str, Any]) -> None:
    nice = f"nice -n {info['nice']} " if info["nice"] else ""
    command = f"{nice}python scripts/reproduce.py" + ("" if not info["argv"] else " " + shlex.join(info["argv"]))
    pictures = "\n\n".join(f"![{f.stem}]({os.path.relpath(f, doc.parent)})" for f in figures)
    machine = info["machine"]
    study_flag = "" if args.study == "claims" else f" --study {args.study}"
    text = f"""# {TITLES[args.study]}: {task.title}

Generated by `scripts/reproduce.py --task {task.name}{study_flag}` (the tables, command, machine and timing; the
analysis section is written by hand and kept when the script writes this file again).

## Command, machine, time

```bash
{command}
```

* commit `{info['commit']}`; {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, torch
{machine['torch']}
* {args.jobs} runs at once, {max(1, args.threads // args.jobs)} torch thread(s) each
{timing_lines(info)}

## Setup

{setup_text(args, task)}
{chr(10) + STUDY_SETUP[args.study] + chr(10) if args.study in STUDY_SETUP else ""}
{FIGURES_TEXT.format(mse=MSE_TEXT.format(every=args.oracle_every, samples=args.oracle_samples)
                      if args.oracle_every else NO_MSE_TEXT)}

## Results (mean ± sd over seeds)

{results_table(per_run)}{exploration_table(per_run)}{passk_table(per_run)}
## The claims, seed by seed

Differences are paired by seed. Verdict rule: *supported* when every seed shows the claimed direction and
|mean| ≥ 2·sd/√n; *contradicted* when the same holds the other way; otherwise *not resolved*.

{claims_table(per_run)}
{pictures}

## What this supports, and what it does not

{START}
{kept_analysis(doc)}
{END}
"""
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
