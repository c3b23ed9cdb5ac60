"""Faults (docs/architecture.md §10): a NaN loss is skipped and counted, too many in a row stop the run with an
error that names `algorithm.max_bad_steps` and leaves `last.ckpt` loadable; a raising or hanging reward costs only its
rollouts (malformed, counted); a failing engine stops with an error that says the last checkpoint is intact;
SIGTERM saves and exits, and the run resumes to the end. Each fault is a `python train.py` run; they start
together when this module starts. With FAULT_REPORT=PATH each test appends a JSON line (scripts/fault_report.py)."""

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
SMALL = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
         "algorithm.group_size=4", "checkpoint_every=1"]
FAULTY = "algorithm._target_=tests.fault_helpers.FaultyModule"


class Run:
    """One `python train.py` in the background, output in a log file beside its run dir."""

    def __init__(self, run_dir: Path, *overrides: str, env: dict | None = None):
        self.dir, self.log = run_dir, run_dir.with_suffix(".log")
        self.proc = subprocess.Popen([sys.executable, "train.py", *SMALL, f"hydra.run.dir={run_dir}", *overrides],
                                     cwd=REPO, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait(self, timeout: float = 240) -> tuple[int, str]:
        return self.proc.wait(timeout=timeout), self.log.read_text()

    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    def rows(self) -> list[dict[str, str]]:
        return [r for r in csv.DictReader((self.dir / "metrics.csv").open()) if r.get("reward/mean")]

    def checkpoint(self) -> dict:
        return torch.load(self.dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    started = {
        "nan_once": Run(root / "nan_once", FAULTY, "+algorithm.nan_calls=[2]", "trainer.max_steps=3"),
        "nan_always": Run(root / "nan_always", FAULTY, "+algorithm.nan_from=2", "algorithm.max_bad_steps=2",
                          "trainer.max_steps=5"),
        # M3PO: 2 loss passes per step; the first pass's gradient is NaN on the second call, the last pass's finite
        "m3po_nan_grad": Run(root / "m3po_nan_grad", "algorithm=m3po", FAULTY, "+algorithm.nan_grad_calls=[2]",
                             "algorithm.callbacks.param_noise.num_samples=2", "algorithm.group_size=4",
                             "trainer.max_steps=3"),
        "raising_reward": Run(root / "raising_reward", "reward.name=tests.fault_helpers:raising_reward",
                              "trainer.max_steps=2"),
        "hanging_reward": Run(root / "hanging_reward", "reward.name=tests.fault_helpers:hanging_reward",
                              "+reward.options.isolation=process", "+reward.options.timeout_s=0.5",
                              "trainer.max_steps=2"),
        "engine": Run(root / "engine", FAULTY, "+algorithm.engine_fail_call=2", "trainer.max_steps=4"),
    }
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()


def report(**record) -> None:
    path = os.environ.get("FAULT_REPORT")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def test_nan_loss_step_is_skipped_counted_and_training_continues(runs):
    run = runs["nan_once"]
    rc, log = run.wait()
    assert rc == 0, log[-3000:]
    summary = run.summary()  # 4 RL steps, one skipped: 3 optimizer steps
    assert (summary["skipped_steps"], summary["steps"], summary["optimizer_steps"]) == (1, 4, 3)
    rows = run.rows()
    assert len(rows) == 4 and float(rows[-1]["train/skipped_steps"]) == 1.0  # 4 batches for 3 optimizer steps
    assert "non-finite loss" in log
    report(fault="NaN loss on one step", bad_inputs=1, survived=True, data_lost=0)


def test_m3po_nan_gradient_in_an_earlier_loss_pass_skips_the_step(runs):
    """Each M3PO loss pass starts from a cleared .grad: a NaN gradient of the first pass is caught although the
    last pass's gradient is finite, and IVON's mean stays finite."""
    run = runs["m3po_nan_grad"]
    rc, log = run.wait()
    assert rc == 0, log[-3000:]
    summary = run.summary()  # 4 RL steps, one skipped: 3 optimizer steps
    assert (summary["skipped_steps"], summary["steps"], summary["optimizer_steps"]) == (1, 4, 3)
    assert "non-finite gradient" in log
    weights = run.checkpoint()["state_dict"]
    assert all(torch.isfinite(w).all() for k, w in weights.items() if k.startswith("policy."))
    report(fault="NaN gradient in one M3PO loss pass", bad_inputs=1, survived=True, data_lost=0)


def test_nan_losses_in_a_row_stop_with_max_bad_steps_and_checkpoint_intact(runs):
    run = runs["nan_always"]
    rc, log = run.wait()
    assert rc != 0 and "NonFiniteError" in log and "algorithm.max_bad_steps=2" in log, log[-3000:]
    state = run.checkpoint()  # written at step 1, before the bad steps; loads
    assert state["global_step"] == 1 and state["lit_rlvr"]["counters"]["skipped_steps"] == 0
    assert not list((run.dir / "checkpoints").glob("*.tmp"))
    report(fault="NaN loss every step", bad_inputs=2, survived=False, stopped_cleanly=True, data_lost=0)


@pytest.mark.parametrize("name", ["raising_reward", "hanging_reward"])
def test_failing_reward_marks_rollouts_malformed_and_run_completes(runs, name):
    run = runs[name]
    rc, log = run.wait()
    assert rc == 0, log[-3000:]
    summary = run.summary()
    assert summary["steps"] == 2 and summary["reward_failures"] > 0
    assert any(float(r["reward/malformed_frac"]) > 0 for r in run.rows())
    report(fault=name.replace("_", " "), bad_inputs=summary["reward_failures"], survived=True, data_lost=0)


def test_engine_failure_says_checkpoint_is_intact_and_it_loads(runs):
    run = runs["engine"]
    rc, log = run.wait()
    assert rc != 0 and "EngineError" in log and "failed at step 2" in log, log[-3000:]
    assert "last checkpoint" in log and "is intact" in log and "resume=" in log
    assert run.checkpoint()["global_step"] == 1
    report(fault="engine.generate raises", bad_inputs=1, survived=False, stopped_cleanly=True, data_lost=0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_and_exits_then_resumes_to_the_end(runs, tmp_path, signum):
    for run in runs.values():  # 2 cores: the other runs end first, so this one is signalled mid-run
        run.proc.wait(timeout=300)
    run = Run(tmp_path / "sigterm", "trainer.max_steps=10000", "checkpoint_every=1000",
              "logger.csv.flush_logs_every_n_steps=1")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_rows(run.dir)) < 2:
            time.sleep(0.5)
        assert len(_rows(run.dir)) >= 2, run.log.read_text()[-3000:]
        run.proc.send_signal(signum)
        rc, log = run.wait(timeout=60)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    name = signal.Signals(signum).name
    assert rc == 0 and name in log, log[-3000:]
    stopped_at = run.checkpoint()["global_step"]
    assert 2 <= stopped_at < 10000 and run.summary()[f"stopped_by_{name.lower()}"]
    final = Run(run.dir, f"trainer.max_steps={stopped_at + 2}",
                f"resume={run.dir}/checkpoints/last.ckpt")
    rc, log = final.wait()
    assert rc == 0, log[-3000:]
    steps = sorted(int(r["step"]) for r in final.rows())
    assert steps == list(range(stopped_at + 2))  # nothing lost, nothing repeated
    report(fault=f"{name} mid-run", bad_inputs=1, survived=True, data_lost=0)


def _rows(run_dir: Path) -> list:
    path = run_dir / "metrics.csv"
    return [r for r in csv.DictReader(path.open()) if r.get("reward/mean")] if path.exists() else []
