"""What users run (issue 19, point 1): the defaults, with `eval_before=true`, through epoch ends, a SIGTERM or a
Ctrl-C, and a resume. Before the fix, validation before training left inference-mode metric states that the
validation at an epoch end (or at a signal's stop) could not update: the run crashed, and a signal exited 1
without summary.json. Each case is a `python train.py` subprocess."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMALL = ["eval_before=true", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
         "algorithm.group_size=4", "checkpoint_every=1"]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    log = run_dir.with_name(f"{run_dir.name}.{time.monotonic_ns()}.log")
    proc = subprocess.Popen([sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = proc.log.read_text()
    assert rc == 0, text[-3000:]
    return text


def rows(run_dir: Path) -> dict[int, dict[str, str]]:
    """Training rows of metrics.csv by step, timing columns dropped."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return {}
    return {int(r["step"]): {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
            for r in csv.DictReader(path.open()) if r.get("reward/mean")}


def signal_when(proc: subprocess.Popen, run_dir: Path, steps: int, signum: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(rows(run_dir)) < steps and proc.poll() is None:
        time.sleep(0.5)
    assert len(rows(run_dir)) >= steps, proc.log.read_text()[-3000:]
    proc.send_signal(signum)


def report(fault: str) -> None:
    if os.environ.get("FAULT_REPORT"):
        with open(os.environ["FAULT_REPORT"], "a") as handle:
            handle.write(json.dumps({"fault": fault, "bad_inputs": 1, "survived": True, "data_lost": 0}) + "\n")


def test_epoch_ends_with_eval_before_and_an_exact_resume_across_them(tmp_path):
    """8 training rows, 4 per step: an epoch ends every 2 steps (validation runs inside fit there)."""
    epochs = [*(o for o in SMALL if not o.startswith("data.num_test")), "data=jsonl", "data.eval_limit=4",
              f"data.path={REPO}/tests/fixtures/eight_rows.jsonl", "reward=arithmetic",
              "algorithm.max_new_tokens=8"]  # (data=jsonl's 1024 does not fit the tiny model)
    full, part = start(tmp_path / "full", *epochs, "trainer.max_steps=5"), start(tmp_path / "part", *epochs,
                                                                                 "trainer.max_steps=3")
    finish(full), finish(part)
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["accuracy_before"] == summary["accuracy_before"]  # not NaN: it ran
    finish(start(tmp_path / "part", *epochs, "trainer.max_steps=5", f"resume={tmp_path}/part/checkpoints/last.ckpt"))
    expected, resumed = rows(tmp_path / "full"), rows(tmp_path / "part")
    assert sorted(resumed) == list(range(5)) and resumed == expected
    # a resume of the finished run trains nothing and still counts its 5 steps (it said 4: reproduce.py refused it)
    finish(start(tmp_path / "full", *epochs, "trainer.max_steps=5", f"resume={tmp_path}/full/checkpoints/last.ckpt"))
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["steps"] == 5
    evaluations = [r for r in csv.DictReader((tmp_path / "full" / "metrics.csv").open()) if r.get("val/accuracy")]
    assert [r["step"] for r in evaluations] == ["0", "1", "3", "5"]  # before, 2 epoch ends, after (not at 4)
    report("epoch ends, eval_before=true")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_with_eval_before_exits_0_with_summary_and_resumes(tmp_path, signum):
    run_dir = tmp_path / "run"
    proc = start(run_dir, *SMALL, "trainer.max_steps=10000", "checkpoint_every=1000",
                 "logger.csv.flush_logs_every_n_steps=1")
    signal_when(proc, run_dir, 2, signum)
    name = signal.Signals(signum).name
    finish(proc, timeout=120)
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, mmap=True)["global_step"]
    assert summary[f"stopped_by_{name.lower()}"] and summary["steps"] == stopped >= 2
    finish(start(run_dir, *SMALL, f"trainer.max_steps={stopped + 2}", "checkpoint_every=1000",
                 "logger.csv.flush_logs_every_n_steps=1", f"resume={run_dir}/checkpoints/last.ckpt"))
    assert sorted(rows(run_dir)) == list(range(stopped + 2))
    report(f"{name}, eval_before=true")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_evaluation_before_training_stops_the_run_before_it_trains(tmp_path, signum):
    """Lightning's SIGTERM flag, set during `validate`, was cleared when `fit` started: the run trained to its end."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "eval_before=true", "data.num_test=32", "callbacks.progress=null", "data.batch_size=4",
                 "algorithm.group_size=4", "trainer.max_steps=3", "stop_grace_s=2",
                 "reward.name=tests.fault_helpers:announced_slow_reward")
    deadline = time.monotonic() + 300
    while "REWARD CALLED" not in proc.log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signum)
    signalled = time.monotonic()
    text = finish(proc, timeout=120)
    summary = json.loads((run_dir / "summary.json").read_text())
    name = signal.Signals(signum).name
    assert summary[f"stopped_by_{name.lower()}"] and summary["steps"] == 0, text[-2000:]
    assert rows(run_dir) == {} and not (run_dir / "checkpoints" / "last.ckpt").exists()
    assert f"stopped by {name} during the evaluation before training: nothing was trained" in text
    assert time.monotonic() - signalled < 60  # the evaluation given up stop_grace_s after the signal, not finished
    report(f"{name} during eval_before")


def test_default_train_py_sigterm_at_step_5_exits_0_and_resume_is_exact(tmp_path):
    """`python train.py` as shipped (only where it writes, and metrics flushed each step so the test sees them)."""
    default = ["logger.csv.flush_logs_every_n_steps=1"]
    proc = start(tmp_path / "stopped", *default)
    signal_when(proc, tmp_path / "stopped", 5, signal.SIGTERM)
    finish(proc, timeout=180)
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["stopped_by_sigterm"] and stopped >= 5
    resumed = start(tmp_path / "stopped", *default, f"trainer.max_steps={stopped + 2}",
                    f"resume={tmp_path}/stopped/checkpoints/last.ckpt")
    full = start(tmp_path / "full", *default, f"trainer.max_steps={stopped + 2}")
    finish(resumed), finish(full)
    expected, got = rows(tmp_path / "full"), rows(tmp_path / "stopped")
    assert sorted(got) == list(range(stopped + 2)) and got == expected
    report("default run: SIGTERM at step ~5")
