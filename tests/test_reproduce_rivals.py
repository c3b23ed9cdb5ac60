"""`scripts/reproduce.py --study rivals` (docs/results/rivals.md): its methods and pinned settings, claims paired on
the seeds both methods have, the pass@k ladder, and a two-step run whose doc `--report-only` writes again from the
finished runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import reproduce  # noqa: E402
from reproduce_report import claims_table  # noqa: E402
from reproduce_settings import STUDY_RIVALS, TASKS  # noqa: E402


def test_rivals_study_methods_and_pins():
    args = reproduce.parse_args(["--task", "arithmetic_cot", "--study", "rivals"])
    assert args.methods == STUDY_RIVALS and Path(args.doc).name == "rivals.md"
    assert args.eval_samples == 16 and args.oracle_every == 0
    task = TASKS["arithmetic_cot"]
    runs = {m: reproduce.overrides(task, m, 1, args, Path("/tmp/x")) for m in STUDY_RIVALS}
    for run in runs.values():  # every method on the same fixed training set, evaluated with 16 samples
        assert [o for o in run if o.startswith("data.num_train=")] == ["data.num_train=320"]
        assert "algorithm.eval_samples=16" in run and not any("OracleBaseline" in o for o in run)
    assert "algorithm.advantages=dbb" in runs["dbb"]
    assert "algorithm.callbacks.value_prior.allocation=uniform" in runs["v05_uniform"]
    assert "algorithm.callbacks.value_prior.allocation=beta" in runs["v05_beta"]
    assert not any("allocation" in o for o in runs["v05"])  # OSLA, the default
    for gated in ("grpo_g16_gate", "c3po_tuned_gate"):
        assert "algorithm.boundary_gating=true" in runs[gated]
    assert "algorithm.optimizer_options.ess=10000000000.0" in runs["c3po_tuned"]
    claims = reproduce.parse_args(["--task", "arithmetic_cot"])  # the claims study keeps its 100000 prompts
    assert "data.num_train=100000" in reproduce.overrides(task, "grpo_g16", 0, claims, Path("/tmp/x"))


def _run(seed, acc, rollouts=100.0):
    return {"seed": seed, "acc_after": acc, "pass_after": acc, "rollouts": rollouts,
            "curve": [{"step": 0, "rollouts": 0.0, "acc": 0.0, "pass": 0.0},
                      {"step": 1, "rollouts": rollouts, "acc": acc, "pass": acc}]}


def test_claims_pair_on_common_seeds():
    per_run = {"v05": [_run(0, 0.5), _run(1, 0.6), _run(2, 0.7)], "dbb": [_run(0, 0.4), _run(2, 0.6)]}
    table = claims_table(per_run)
    row = next(line for line in table.splitlines() if line.startswith("| V0.5 beats DBB: held-out accuracy after"))
    assert "+0.100, +0.100" in row and "2/2" in row  # seeds 0 and 2 only, each against its own seed
    row = next(line for line in table.splitlines() if line.startswith("| V0.5 beats DBB at equal rollouts"))
    assert "2/2" in row


def test_pass_ladder_reads_the_last_evaluation():
    class Run:
        val = pd.DataFrame({"step": [0, 50], "val/accuracy": [0.2, 0.4], "val/pass@2": [0.3, 0.5],
                            "val/pass@4": [0.4, 0.6], "val/pass@k": [0.5, 0.7]})

    ladder = reproduce.pass_ladder(Run(), {"accuracy_after": 0.4, "pass_at_k_after": 0.8}, 8)
    assert ladder == {1: 0.4, 2: 0.5, 4: 0.6, 8: 0.8}


def test_rivals_study_tiny_and_report_only(tmp_path):
    """Two methods, two steps on the 3-token task; then --report-only with 2 seeds asked writes the doc from the one
    finished seed (and refuses when nothing finished)."""
    doc = tmp_path / "rivals.md"
    common = ["scripts/reproduce.py", "--study", "rivals", "--steps", "2", "--batch-size", "4", "--num-test", "8",
              "--eval-samples", "4", "--eval-every", "1", "--out-dir", str(tmp_path / "runs"), "--doc", str(doc),
              "--methods", "grpo_g16_gate,dbb", "--set", "data.num_train=4"]
    env = {**os.environ, "LIT_RLVR_CACHE": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr")}
    proc = subprocess.run([sys.executable, *common, "--seeds", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = doc.read_text()
    assert text.startswith("# V0.5 and 3PO against their cheapest rivals") and "--study rivals" in text
    assert "### Held-out pass@k after training, against k" in text and "| pass@1 | pass@2 | pass@4 |" in text
    assert (tmp_path / "rivals_passk.png").stat().st_size > 5_000
    raw = json.loads((tmp_path / "rivals.json").read_text())
    gate = raw["methods"]["grpo_g16_gate"]["seeds"][0]
    assert set(gate["pass_ladder"]) == {"1", "2", "4"} and gate["seed"] == 0
    metrics = pd.read_csv(tmp_path / "runs" / "arithmetic" / "grpo_g16_gate" / "seed0" / "metrics.csv")
    assert metrics["history/gated_frac"].dropna().iloc[-1] > 0  # 4 prompts, 2 steps: the second step gates
    doc.unlink()
    proc = subprocess.run([sys.executable, *common, "--seeds", "2", "--report-only"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[done]" not in proc.stdout and "DBB (G = 8" in doc.read_text()
    proc = subprocess.run([sys.executable, *common, "--seeds", "1", "--report-only", "--steps", "3"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "no finished run" in proc.stderr
