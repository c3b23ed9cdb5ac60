"""`python -m lit_rlvr.run.report`: reads Lightning's sparse metrics.csv, and renders two real runs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_rlvr.run import report

ROOT = Path(__file__).resolve().parents[1]


def test_read_metrics_sparse_rows(tmp_path):
    # as Lightning writes it: validation rows apart, train metrics of one step split over two rows
    (tmp_path / "metrics.csv").write_text(
        "epoch,step,reward/accuracy,rollouts/total,grad/norm,val/accuracy\n"
        ",0,,,,0.25\n"
        "0,0,0.5,64,,\n"
        "0,0,,,1.5,\n"
        "0,1,0.75,128,2.5,\n"
        ",2,,,,0.5\n")
    run = report.load_run(tmp_path)
    assert run.train["step"].tolist() == [0, 1]
    assert run.train["grad/norm"].tolist() == [1.5, 2.5] and run.train["reward/accuracy"].tolist() == [0.5, 0.75]
    assert run.val["val/accuracy"].tolist() == [0.25, 0.5]
    assert run.val["rollouts"].tolist() == [0.0, 128.0]  # validation at step 2 follows train rows 0 and 1
    assert run.label == tmp_path.name  # no summary.json
    row = report.table([run]).splitlines()[2]
    assert "0.25 → 0.50" in row.replace("0.250", "0.25").replace("0.500", "0.50")
    assert math.isnan(report.tail_mean(run.train, "loss/entropy"))  # an absent column is "—", not an error
    # a run that trains on part of what it generated (DAPO) is judged on all its rollouts
    (tmp_path / "metrics.csv").write_text("epoch,step,reward/accuracy,reward/accuracy_generated\n0,0,0.5,0.25\n")
    assert report.load_run(tmp_path).train["reward/accuracy"].tolist() == [0.25]
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        report.load_run(tmp_path / "missing")


def test_read_metrics_places_validations_inside_fit(tmp_path):
    # before fit (step 0), inside fit after updates 1 and 2 (Lightning logs them at steps 0 and 1, the module adds
    # val/rl_steps), after fit (step 2, by trainer.validate): each at the updates its policy had
    (tmp_path / "metrics.csv").write_text(
        "epoch,step,reward/accuracy,rollouts/total,val/accuracy,val/rl_steps\n"
        ",0,,,0.25,\n"
        "0,0,0.5,64,,\n"
        "0,0,,,0.30,1\n"
        "0,1,0.75,128,,\n"
        "0,1,,,0.40,2\n"
        ",2,,,0.40,\n")
    val = report.load_run(tmp_path).val
    assert val["step"].tolist() == [0, 1, 2, 2]
    assert val["val/accuracy"].tolist() == [0.25, 0.30, 0.40, 0.40]
    assert val["rollouts"].tolist() == [0.0, 64.0, 128.0, 128.0]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> list[Path]:
    """Two short train.py runs (grpo and dr_grpo), side by side."""
    base = tmp_path_factory.mktemp("report")
    runs = [base / "run_grpo", base / "run_dr_grpo"]
    env = {**os.environ, "LIT_RLVR_CACHE": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr")}
    procs = [subprocess.Popen([sys.executable, "train.py", f"algorithm={name}", "trainer.max_steps=3",
                               "eval_before=false", "data.batch_size=8",
                               "callbacks.progress=null", "data.num_test=64", f"hydra.run.dir={run}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, run in zip(["grpo", "dr_grpo"], runs)]
    for proc in procs:
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-3000:]
    return runs


def test_report_from_two_runs(two_runs, tmp_path, capsys):
    import matplotlib.image

    out = tmp_path / "cmp.png"
    report.main([str(r) for r in two_runs] + ["--out", str(out)])
    printed = capsys.readouterr().out
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 1000 and image.shape[1] > 2000 and image.std() > 0.05
    markdown = out.with_suffix(".md").read_text()
    for label in ("grpo · run_grpo", "dr_grpo · run_dr_grpo"):
        assert label in printed and label in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| dr_grpo"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["3", "192"]  # steps, rollouts consumed (3 x 8 prompts x 8 samples)


def test_a_path_that_is_no_run_dir_is_one_line(tmp_path, capsys):
    from lit_rlvr.run.report import main

    with pytest.raises(SystemExit) as done:
        main([str(tmp_path / "nowhere")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere: no metrics.csv" in err
