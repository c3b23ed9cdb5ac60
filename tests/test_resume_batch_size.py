"""A resume with another batch size (issue 61, class 9): `data.batch_size=4 resume=<a run of 8>
'resume_allow=[data.batch_size]'` trains every prompt once across the resume: the resumed steps take the prompts that
follow those trained on, in the sampler's order (the data position is kept in prompts, not recomputed from steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lit_rlvr.data.datamodule import ResumableSampler, RLVRDataModule

REPO = Path(__file__).resolve().parents[1]
NUM_TRAIN = 200  # one epoch holds every step of both runs
COMMON = ["eval_before=false", "data.num_test=4", f"data.num_train={NUM_TRAIN}", "callbacks.progress=null",
          "algorithm.group_size=4", "callbacks.completions.every_n_steps=1",
          "callbacks.completions.samples=32"]  # every completion of every step: the prompts each update trained on


def train(run_dir: Path, *overrides: str) -> None:
    done = subprocess.run([sys.executable, "train.py", *COMMON, f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def trained_prompts(run_dir: Path) -> dict[int, set[str]]:
    steps: dict[int, set[str]] = {}
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], set()).add(record["prompt"])
    return steps


def test_a_resume_with_a_smaller_batch_trains_each_prompt_once(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "data.batch_size=8", "trainer.max_steps=2")
    train(run_dir, "data.batch_size=4", "trainer.max_steps=4", f"resume={run_dir}/checkpoints/last.ckpt",
          "resume_allow=[data.batch_size]")
    steps = trained_prompts(run_dir)
    assert sorted(steps) == [0, 1, 2, 3] and [len(steps[s]) for s in range(4)] == [8, 8, 4, 4]
    trained = [p for s in range(4) for p in sorted(steps[s])]
    assert len(set(trained)) == 24  # none twice
    # none skipped: the first 24 prompts of the epoch's order
    data = RLVRDataModule(num_train=NUM_TRAIN, num_test=4, seed=0)
    data.setup("fit")
    first = ResumableSampler(NUM_TRAIN, seed=0).order(0)[:24]
    assert {data.train_set[i]["prompt"] for i in first} == set(trained)


@pytest.mark.parametrize("mode, first_steps", [("sync", 2), ("async", 1)])
def test_the_epochs_after_a_resume_with_a_smaller_batch_are_whole(tmp_path, mode, first_steps):
    """Lightning counts the resumed epoch's batches in the checkpoint's batch size; in this run's, the epoch ends
    where the data does. Before: resumed at an epoch's end (sync: 2 steps of 8 = the 16 prompts) or with a batch in
    flight (async), the next epoch ran 2 batches of 4 and its other 8 prompts were never trained."""
    mode_args = ["rollout.mode=async", "rollout.max_staleness=1"] if mode == "async" else []
    small = ["data.num_train=16", *mode_args]
    run_dir = tmp_path / "run"
    train(run_dir, *small, "data.batch_size=8", f"trainer.max_steps={first_steps}")
    train(tmp_path / "resumed", *small, "data.batch_size=4", "trainer.max_steps=7",
          f"resume={run_dir}/checkpoints/last.ckpt", "resume_allow=[data.batch_size]")
    steps = {**trained_prompts(run_dir), **trained_prompts(tmp_path / "resumed")}
    assert sorted(steps) == list(range(7))
    # epoch 0: steps 0-1 (sync: two batches of 8; async: one, then the batch in flight at the checkpoint)
    epoch_0 = [p for s in (0, 1) for p in steps[s]]
    assert len(epoch_0) == len(set(epoch_0)) == 16
    epoch_1 = [p for s in (2, 3, 4, 5) for p in steps[s]]  # four batches of 4, every prompt once
    assert [len(steps[s]) for s in (2, 3, 4, 5)] == [4] * 4 and len(set(epoch_1)) == 16
