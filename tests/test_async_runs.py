"""`rollout.mode=async` in `python train.py` runs (docs/async.md): S = 0 is the synchronous run with a copy engine
(the same tokens and rewards, floats to rounding: the engine's process or thread is another kernel path; GRPO with
the HF engine in a process of its own, C3PO and V0.5 with it in the producer's thread); with
S = 1 every update trains a batch exactly one version old, across epoch ends; a SIGTERM saves the batches in flight
and exits 0 (the engine's process ends with it), and the resumed run trains every prompt exactly once, in the
uninterrupted run's order; `drop` evicts a stale batch and trains its copy generated again; an engine that fails in
the producer stops the run naming the intact checkpoint. The runs start together when this module starts."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMALL = ["callbacks.progress=null", "data.batch_size=4",
         "algorithm.group_size=4", "checkpoint_every=1", "callbacks.completions.every_n_steps=1",
         "callbacks.completions.samples=16"]  # every completion of every step: the prompts each update trained on
EPOCHS = ["data=jsonl", f"data.path={REPO}/tests/fixtures/eight_rows.jsonl", "data.eval_limit=4",
          "reward=arithmetic", "algorithm.max_new_tokens=8"]  # 8 rows, 4 a step: an epoch ends every 2 steps
ASYNC = ["rollout.mode=async"]
PROCESS = ["engine.options.process=true"]  # the HF engine in a process of its own
TASK = ["data.num_test=4"]  # the built-in task's held-out set, small
NO_EVAL = ["eval_before=false"]  # (the S = 0 comparison keeps the default evaluation before training)
C3PO = ["algorithm=c3po", "algorithm.callbacks.param_noise.num_samples=4"]  # async: drawn when pushed (N > 2)
V05 = ["algorithm=v05", *(f"algorithm.callbacks.value_prior.{k}" for k in (  # the prior present from the 2nd step
    "min_context=4", "k_init=2", "k_max=4", "pad_to=1"))]
# what depends on the machine's speed, or exists only in async mode
UNTIMED = ("time/", "perf/", "async/")
# counts of prompts, tokens and rewards: equal whatever kernels computed the floats (the same tokens were sampled)
EXACT = ("step", "reward/", "response/", "groups/", "rollouts", "tokens", "v05/rollouts_per_prompt", "v05/rounds")


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    log = run_dir.with_suffix(".log").open("w")
    return subprocess.Popen([sys.executable, "train.py", *SMALL, f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 600) -> str:
    rc = proc.wait(timeout=timeout)
    log = run_dir.with_suffix(".log").read_text()
    assert rc == 0, log[-3000:]
    return log


def rows(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / "metrics.csv"
    return [r for r in csv.DictReader(path.open()) if r.get("loss/policy")] if path.exists() else []


def trained_prompts(run_dir: Path) -> dict[int, list[str]]:
    """{step: the sorted prompts its update trained on} from completions.jsonl."""
    steps: dict[int, list[str]] = {}
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).append(record["prompt"])
    return {step: sorted(set(prompts)) for step, prompts in steps.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    specs = {
        "sync": [*TASK, "engine.options.mode=copy", "trainer.max_steps=3"],
        "async0": [*TASK, *ASYNC, *PROCESS, "rollout.max_staleness=0", "trainer.max_steps=3"],
        "full": [*NO_EVAL, *ASYNC, *PROCESS, *EPOCHS, "rollout.max_staleness=1", "trainer.max_steps=5"],
        "engine": [*NO_EVAL, *TASK, *ASYNC, "algorithm._target_=tests.fault_helpers.FaultyModule",
                   "+algorithm.engine_fail_call=3", "trainer.max_steps=6",
                   "engine.options.sync_check_every=0"],  # (the post-push check would meet the failure first)
        "c3po_sync": [*NO_EVAL, *C3PO, *TASK, "engine.options.mode=copy", "trainer.max_steps=2"],
        "c3po_async0": [*NO_EVAL, *C3PO, *TASK, *ASYNC, "rollout.max_staleness=0", "trainer.max_steps=2"],
        "v05_sync": [*NO_EVAL, *V05, *TASK, "engine.options.mode=copy", "trainer.max_steps=2"],
        "v05_async0": [*NO_EVAL, *V05, *TASK, *ASYNC, "rollout.max_staleness=0", "trainer.max_steps=2"],
        "drop": [*NO_EVAL, *TASK, *ASYNC, "rollout.max_staleness=1", "rollout.stale_strategy=drop",
                 "trainer.max_steps=3"],
    }
    procs = {name: (start(root / name, *spec), root / name, spec) for name, spec in specs.items()}
    yield procs
    for proc, _, _ in procs.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sync_run, async_run, steps", [("sync", "async0", 3), ("c3po_sync", "c3po_async0", 2),
                                                      ("v05_sync", "v05_async0", 2)], ids=["grpo", "c3po", "v05"])
def test_staleness_zero_is_the_synchronous_run(runs, sync_run, async_run, steps):
    """C3PO too: the producer pushes the samples drawn at plan time, the bits the synchronous run writes into the
    policy and pushes (its engine a copy, as the async run's). V0.5: OSLA's rounds run in the producer with the
    prior of plan time, which at S = 0 is the synchronous run's."""
    (sync, sync_dir, _), (async0, async_dir, _) = runs[sync_run], runs[async_run]
    finish(sync, sync_dir), finish(async0, async_dir)
    expected, got = rows(sync_dir), rows(async_dir)
    assert len(got) == len(expected) == steps
    for want, have in zip(expected, got):
        keys = {k for k in want if not k.startswith(UNTIMED)}
        assert keys == {k for k in have if not k.startswith(UNTIMED)}
        for key in keys:  # what counts tokens and rewards exactly; the rest to rounding (docs/async.md, S = 0)
            if key.startswith(EXACT) or not want[key] or not have[key] or "nan" in (want[key], have[key]):
                assert have[key] == want[key], (key, have[key], want[key])
            else:
                assert math.isclose(float(have[key]), float(want[key]), rel_tol=1e-4, abs_tol=1e-6), \
                    (key, have[key], want[key])
        assert float(have["async/staleness_max"]) == 0
    if async_run == "v05_async0":  # the comparison covers a step with the prior present
        assert float(got[-1]["v05/prior_present"]) == 1.0
    summary = json.loads((async_dir / "summary.json").read_text())
    assert summary["accuracy_after"] == json.loads((sync_dir / "summary.json").read_text())["accuracy_after"]


def test_staleness_one_across_epochs_then_sigterm_and_resume_train_each_prompt_once(runs):
    full, full_dir, spec = runs["full"]
    stopped_dir = full_dir.with_name("stopped")
    stopped = start(stopped_dir, *spec[:-1], "trainer.max_steps=100")  # started here: stopped at its first save
    deadline = time.monotonic() + 600
    while not (stopped_dir / "checkpoints" / "last.ckpt").exists() and stopped.poll() is None \
            and time.monotonic() < deadline:  # the first step saved: the pipeline is full
        time.sleep(0.05)
    stopped.send_signal(signal.SIGTERM)
    log = finish(stopped, stopped_dir, timeout=120)  # saved and exited 0; the producer did not hold it up
    saved = torch.load(stopped_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    in_flight = saved["lit_rlvr"]["async"]["in_flight"]
    assert len(in_flight) == 1, log[-2000:]  # S = 1, wait: one batch ahead of the trained one
    steps_before = saved["global_step"]
    assert steps_before < 5, "the stop came after the steps this test compares"
    resumed = start(stopped_dir, *spec[:-1], "trainer.max_steps=5", f"resume={stopped_dir}/checkpoints/last.ckpt")
    finish(resumed, stopped_dir)
    finish(full, full_dir)

    assert [int(r["step"]) for r in rows(full_dir)] == [0, 1, 2, 3, 4]  # the filling call writes no row
    assert json.loads((full_dir / "summary.json").read_text())["steps"] == 5
    staleness = [float(r["async/staleness_max"]) for r in rows(full_dir)]
    assert staleness == [0.0, 1.0, 1.0, 1.0, 1.0]  # the first batch was generated before any update
    assert all(float(r["async/in_flight"]) <= 1 for r in rows(full_dir))
    assert all(float(r["async/buffer_mb"]) > 0 for r in rows(full_dir))  # the scored batches' bytes, each step
    expected = trained_prompts(full_dir)
    assert sorted(expected) == [0, 1, 2, 3, 4]  # the rows of metrics.csv
    # across the stop: the same prompts at every step, none twice, none skipped (the batch in flight was generated
    # again with the restored weights)
    assert trained_prompts(stopped_dir) == expected


def test_drop_keeps_the_bound_and_trains_each_prompt_once(runs):
    """S = 1 (drop at S = 0 is refused: every batch would be generated twice): generation runs S + 1 batches ahead,
    a batch past the bound is generated again (how many are depends on when the pushes land; the pipeline's own
    tests count them, tests/test_rollout_pipeline.py), and nothing older than S reaches a loss."""
    (drop, drop_dir, _), (sync, sync_dir, _) = runs["drop"], runs["sync"]
    finish(drop, drop_dir), finish(sync, sync_dir)
    got = rows(drop_dir)
    assert len(got) == 3 and all(float(r["async/staleness_max"]) <= 1.0 for r in got)
    assert trained_prompts(drop_dir) == trained_prompts(sync_dir)  # each prompt trained once, in the sync order


def test_engine_failure_in_the_producer_stops_the_run_naming_the_intact_checkpoint(runs):
    proc, run_dir, _ = runs["engine"]
    rc = proc.wait(timeout=600)
    log = run_dir.with_suffix(".log").read_text()
    assert rc != 0 and "EngineError" in log and "injected engine failure" in log, log[-3000:]
    assert "is intact" in log and "resume=" in log
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] >= 1 and len(saved["lit_rlvr"]["async"]["in_flight"]) == 1
