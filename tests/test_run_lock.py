"""One run per run directory (issue 61, class 10; lit_rlvr/run/run_lock.py): a second run started in a directory
another run holds is refused in one line naming it, from `train.py` and from the Lightning CLI, before it writes
anything there, and the first run goes on untouched; a lock left by a process that died (even by SIGKILL) holds
nothing; ranks other than the first take no lock. A directory that holds a finished run is refused the same way
unless the new run continues it from a checkpoint inside it (train.py's `resume=`; the CLI never does), and its
files are left as they were; a sweep into an earlier sweep's directory is refused before Hydra writes there, and a
stop request during a sweep's job ends the sweep."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.run import run_lock
from lit_rlvr.run.run_lock import LOCK_FILE, hold_run_dir

REPO = Path(__file__).resolve().parents[1]
HOLD = "import sys, time; from pathlib import Path; from lit_rlvr.run.run_lock import hold_run_dir; " \
       "hold_run_dir(Path(sys.argv[1]), 'dir', 'resume'); print('held', flush=True); time.sleep(600)"


def holder(run_dir: Path) -> subprocess.Popen:
    """Another process that holds `run_dir` until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def one_line(proc: subprocess.Popen | subprocess.CompletedProcess) -> str:
    out, err = (proc.stdout, proc.stderr) if isinstance(proc, subprocess.CompletedProcess) else proc.communicate(600)
    assert proc.returncode == 2 and "Traceback" not in out + err, (out + err)[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == "(set LIT_RLVR_DEBUG=1 for the traceback)" and lines[-2].startswith("config error: "), lines
    return lines[-2]


def test_a_held_directory_is_refused_naming_it_and_a_dead_holders_lock_holds_nothing(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    other = holder(run_dir)
    try:
        with pytest.raises(ConfigError, match=f"dir='{run_dir}' is in use by another run \\(pid {other.pid}\\)"):
            hold_run_dir(run_dir, "dir", "resume")
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    assert (run_dir / LOCK_FILE).exists()  # left behind by the killed process, and stale
    hold_run_dir(run_dir, "dir", "resume")  # taken
    hold_run_dir(run_dir, "dir", "resume")  # this process holds it already: a no-op
    monkeypatch.setenv("RANK", "1")  # a rank of a multi-process run shares rank 0's directory
    monkeypatch.setattr(run_lock, "_held", {})
    hold_run_dir(run_dir, "dir", "resume")
    assert run_lock._held == {}


def test_a_second_train_py_in_the_same_run_dir_is_refused_and_the_first_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    common = [sys.executable, "train.py", "eval_before=false", "data.num_test=4", "callbacks.progress=null",
              "data.batch_size=4", "algorithm.group_size=4", f"hydra.run.dir={run_dir}"]
    first = subprocess.Popen([*common, "trainer.max_steps=1000"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # still running when the second is refused
    deadline = time.monotonic() + 300
    # Hydra writes .hydra/ file by file (overrides.yaml last), maybe after the lock is taken: wait for all of it
    while not ((run_dir / LOCK_FILE).exists() and (run_dir / ".hydra" / "overrides.yaml").exists()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    hydra_files = sorted(p.name for p in (run_dir / ".hydra").iterdir())
    second = subprocess.run([*common, "trainer.max_steps=2", "seed=1"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    line = one_line(second)
    assert f"hydra.run.dir='{run_dir}' is in use by another run (pid {first.pid})" in line, line
    assert first.poll() is None
    first.send_signal(signal.SIGTERM)  # saves and stops
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-3000:]
    with (run_dir / "metrics.csv").open() as handle:  # the first run's steps, in order, none of the second's
        steps = [int(r["step"]) for r in csv.DictReader(handle) if r.get("loss/policy")]
    assert steps == list(range(len(steps)))
    assert "seed: 1" not in (run_dir / ".hydra" / "config.yaml").read_text()
    assert hydra_files == sorted(p.name for p in (run_dir / ".hydra").iterdir())


def test_the_lightning_cli_refuses_a_held_directory_in_one_line(tmp_path):
    run_dir = tmp_path / "cli"
    other = holder(run_dir)
    exe = shutil.which("lit-rlvr")
    command = [exe] if exe else [sys.executable, "-m", "lit_rlvr.app.cli"]
    try:
        done = subprocess.run([*command, "fit", "--config", str(REPO / "conf" / "cli" / "tiny_grpo.yaml"),
                               "--trainer.max_steps", "1", "--trainer.logger.init_args.save_dir", str(run_dir)],
                              cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "LIT_RLVR_DEBUG": ""})
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    line = one_line(done)
    assert f"--trainer.logger.init_args.save_dir='{run_dir}' is in use by another run (pid {other.pid})" in line
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing written


def test_a_file_system_without_locks_runs_unguarded_and_says_so(tmp_path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with caplog.at_level("WARNING"):
        hold_run_dir(tmp_path / "nfs", "dir", "resume")
    assert "cannot lock" in caplog.text and "would not be refused" in caplog.text


def test_a_directory_an_earlier_run_left_is_refused_unless_the_run_continues_it(tmp_path, monkeypatch):
    for name in ("metrics.csv", "checkpoints", "summary.json", "eval.json"):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / name).mkdir() if name == "checkpoints" else (run_dir / name).write_text("x")
        with pytest.raises(ConfigError, match=f"dir='{run_dir}' holds an earlier run \\({name}\\), which a new run "
                                              "there would overwrite: pass dir=ANOTHER_DIR \\(that run saved no "
                                              "checkpoint to continue from\\)"):
            hold_run_dir(run_dir, "dir", "resume")
        assert run_dir not in run_lock._held
        elsewhere = tmp_path / "other" / "checkpoints" / "last.ckpt"  # another run's checkpoint: refused too
        with pytest.raises(ConfigError, match="holds an earlier run"):
            hold_run_dir(run_dir, "dir", "resume", str(elsewhere))
        hold_run_dir(run_dir, "dir", "resume", str(run_dir / "checkpoints" / "last.ckpt"))  # continues it
        assert run_dir in run_lock._held
    monkeypatch.setattr(run_lock, "_held", {})

    def no_locks(fd, operation):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with pytest.raises(ConfigError, match="holds an earlier run"):  # refused on a file system without locks too
        hold_run_dir(tmp_path / "metrics.csv", "dir", "resume")


def test_a_finished_runs_directory_is_refused_by_both_entry_points_and_a_resume_continues_it(tmp_path):
    run_dir = tmp_path / "run"
    common = [sys.executable, "train.py", "eval_before=false", "data.num_test=4", "callbacks.progress=null",
              "data.batch_size=4", "algorithm.group_size=4"]
    first = subprocess.run([*common, "trainer.max_steps=3", f"hydra.run.dir={run_dir}"], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    last = run_dir / "checkpoints" / "last.ckpt"
    again = subprocess.run([*common, "trainer.max_steps=2", "seed=1", f"hydra.run.dir={run_dir}"], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert one_line(again) == (f"config error: hydra.run.dir='{run_dir}' holds an earlier run (metrics.csv, "
                               "checkpoints, summary.json), which a new run there would overwrite: pass "
                               f"hydra.run.dir=ANOTHER_DIR, or continue that run with resume={last}")
    evaluated = subprocess.run([sys.executable, "train.py", "mode=eval", f"checkpoint={last}",
                                f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert one_line(evaluated) == (f"config error: hydra.run.dir='{run_dir}' holds an earlier run (metrics.csv, "
                                   "checkpoints, summary.json), which a new run there would overwrite: pass "
                                   "hydra.run.dir=ANOTHER_DIR")  # an evaluation's logger would start metrics.csv anew
    other = tmp_path / "other"  # a third run's checkpoint into this run's directory: not this run's continuation
    (other / "checkpoints").mkdir(parents=True)
    shutil.copy(last, other / "checkpoints" / "last.ckpt")
    crossed = subprocess.run([*common, "trainer.max_steps=4", f"resume={other}/checkpoints/last.ckpt",
                              f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert "holds an earlier run" in one_line(crossed)
    assert files == {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}  # untouched
    resumed = subprocess.run([*common, "trainer.max_steps=4", f"resume={last}", f"hydra.run.dir={run_dir}"],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with (run_dir / "metrics.csv").open() as handle:
        assert [int(r["step"]) for r in csv.DictReader(handle) if r.get("loss/policy")] == [0, 1, 2, 3]
    exe = shutil.which("lit-rlvr")
    cli = [exe] if exe else [sys.executable, "-m", "lit_rlvr.app.cli"]
    config = ["--config", str(REPO / "conf" / "cli" / "tiny_grpo.yaml"), "--trainer.logger.init_args.save_dir",
              str(tmp_path / "cli")]
    env = {**os.environ, "LIT_RLVR_DEBUG": ""}
    fitted = subprocess.run([*cli, "fit", *config, "--trainer.max_steps", "1"], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env=env)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    metrics = (tmp_path / "cli" / "metrics.csv").read_bytes()
    cli_last = tmp_path / "cli" / "checkpoints" / "last.ckpt"
    # the CLI continues a run into a new directory only: its CSVLogger would drop the rows before the checkpoint
    for command in (["fit"], ["validate", "--ckpt_path", str(cli_last)], ["fit", "--ckpt_path", str(cli_last)]):
        done = subprocess.run([*cli, *command, *config], cwd=REPO, capture_output=True, text=True, timeout=600,
                              env=env)
        assert one_line(done) == (f"config error: --trainer.logger.init_args.save_dir='{tmp_path / 'cli'}' holds an "
                                  "earlier run (metrics.csv, checkpoints), which a new run there would overwrite: "
                                  "pass --trainer.logger.init_args.save_dir=ANOTHER_DIR")
        assert (tmp_path / "cli" / "metrics.csv").read_bytes() == metrics


def test_a_sweep_into_an_earlier_sweeps_directory_is_refused_and_a_stop_ends_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    command = [sys.executable, "train.py", "-m", "eval_before=false", "data.num_test=4", "callbacks.progress=null",
               "data.batch_size=2", "algorithm.group_size=2", "trainer.max_steps=1000", "seed=1,2",
               f"hydra.sweep.dir={sweep}"]
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (sweep / "0" / "metrics.csv").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)  # job 0 saves and stops; job 1 must not start
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    assert (sweep / "0" / "checkpoints" / "last.ckpt").exists() and not (sweep / "1").exists()
    recorded = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    again = subprocess.run([*command[:-2], "seed=3", f"hydra.sweep.dir={sweep}"], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert one_line(again) == (f"config error: hydra.sweep.dir='{sweep}' holds an earlier sweep's runs (jobs 0), "
                               "which this sweep would overwrite: pass hydra.sweep.dir=ANOTHER_DIR")
    assert recorded == {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}  # multirun.yaml, .hydra/ too


def test_the_jobs_of_a_sweep_that_share_one_directory_are_refused_after_the_first(tmp_path):
    """`hydra.sweep.subdir=.` gives every job the sweep's directory: the second job (in the process that holds the
    directory for the first) is refused, not trained over the first one's files (Hydra has written its `.hydra/`
    record there before any of lit-rlvr's code runs)."""
    sweep = tmp_path / "shared"
    done = subprocess.run([sys.executable, "train.py", "-m", "eval_before=false", "data.num_test=4",
                           "callbacks.progress=null", "data.batch_size=2", "algorithm.group_size=2",
                           "trainer.max_steps=1", "seed=1,2", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=."],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert "holds an earlier run (metrics.csv, checkpoints, summary.json)" in one_line(done)
    with (sweep / "metrics.csv").open() as handle:  # the first job's one step, as it left them
        assert [int(r["step"]) for r in csv.DictReader(handle) if r.get("loss/policy")] == [0]
    assert json.loads((sweep / "summary.json").read_text())["steps"] == 1
