"""Exact resume (docs/architecture.md §10): a 6-step run and a 3-step run resumed to 6 write the same metrics.csv
rows for steps 4-6, bit for bit on CPU, timing columns aside. The runs are `python train.py` subprocesses; the full run
and the first half of the resumed one run side by side."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMALL = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
         "algorithm.group_size=4", "checkpoint_every=1"]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """`python train.py` in the background; its output goes to a log file beside the run dir."""
    log = run_dir.parent / f"{run_dir.name}.{len(list(run_dir.parent.glob(run_dir.name + '.*.log')))}.log"
    proc = subprocess.Popen([sys.executable, "train.py", *SMALL, f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    proc.log = log
    return proc


def _wait(proc: subprocess.Popen, timeout: float = 240) -> None:
    assert proc.wait(timeout=timeout) == 0, proc.log.read_text()[-3000:]


def train_rows(path: Path) -> dict[int, dict[str, str]]:
    """Training rows of a metrics.csv by step, timing columns dropped."""
    rows = {}
    for row in csv.DictReader(path.open()):
        if row.get("reward/mean"):
            rows[int(row["step"])] = {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}
    return rows


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """Per algorithm: a 6-step run and a 3-step run resumed to 6 (grpo into the same dir, c3po into a fresh
    one); the first halves all run side by side, then the resumes."""
    root = tmp_path_factory.mktemp("resume")
    plans = {"grpo": True, "c3po": False, "v05": False}
    extra = {"v05": ["algorithm.callbacks.value_prior.min_context=8"]}  # the prior is present from step 3 on
    first = [_start(root / f"{algo}_{kind}", f"algorithm={algo}", f"trainer.max_steps={steps}", *extra.get(algo, []))
             for algo in plans for kind, steps in (("full", 6), ("part", 3))]
    for proc in first:
        _wait(proc)
    resumes = {algo: root / (f"{algo}_part" if same_dir else f"{algo}_resumed") for algo, same_dir in plans.items()}
    second = [_start(run_dir, f"algorithm={algo}", "trainer.max_steps=6",
                     f"resume={root}/{algo}_part/checkpoints/last.ckpt",
                     *extra.get(algo, [])) for algo, run_dir in resumes.items()]
    for proc in second:
        _wait(proc)
    return {algo: (train_rows(root / f"{algo}_full" / "metrics.csv"), train_rows(run_dir / "metrics.csv"), run_dir)
            for algo, run_dir in resumes.items()}


def _assert_same_steps(full: dict, resumed: dict, steps: range) -> None:
    for step in steps:
        diff = {k: (full[step].get(k), resumed[step].get(k)) for k in set(full[step]) | set(resumed[step])
                if full[step].get(k) != resumed[step].get(k)}
        assert not diff, f"step {step + 1} differs after resume: {diff}"


def test_grpo_resume_into_same_dir_is_exact_and_keeps_earlier_rows(split_runs):
    full, resumed, run_dir = split_runs["grpo"]
    assert sorted(full) == sorted(resumed) == list(range(6))  # steps 1-3 kept across the resume, 4-6 appended
    _assert_same_steps(full, resumed, range(6))
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 6 and state["RLVRDataModule"] == {"epoch": 0, "prompts": 24, "batch_size": 4}
    assert {"python", "numpy", "torch"} <= set(state["lit_rlvr"]["rng"])
    assert not (run_dir / "metrics.before_resume.csv").exists()
    _report("resume grpo into the same run dir")


def test_c3po_resume_into_fresh_dir_is_exact(split_runs):
    full, resumed, _ = split_runs["c3po"]
    assert sorted(resumed) == [3, 4, 5]
    _assert_same_steps(full, resumed, range(3, 6))
    _report("resume c3po into a fresh run dir")


def test_v05_resume_keeps_the_value_prior_context(split_runs):
    full, resumed, _ = split_runs["v05"]
    assert sorted(resumed) == [3, 4, 5]
    assert float(resumed[3]["v05/prior_present"]) == 1.0  # the restored context drives step 4's prior
    _assert_same_steps(full, resumed, range(3, 6))  # the checkpoint holds the context's prompt features
    _report("resume v05 into a fresh run dir")


def _report(fault: str) -> None:
    """A line for scripts/fault_report.py: a stop at step 3 lost nothing (steps 4-6 identical)."""
    if os.environ.get("FAULT_REPORT"):
        with open(os.environ["FAULT_REPORT"], "a") as handle:
            handle.write(json.dumps({"fault": fault, "bad_inputs": 1, "survived": True, "data_lost": 0}) + "\n")


def test_datamodule_position_survives_state_dict():
    """The sampler's order is a function of (seed, epoch); a loaded position skips the batches already used."""
    from lit_rlvr.data.datamodule import RLVRDataModule

    def batches(dm, n):
        it = iter(dm.train_dataloader())
        return [next(it)["prompt"] for _ in range(n)]

    first = RLVRDataModule(batch_size=2, num_train=20, num_test=2, seed=3)
    first.setup("fit")
    whole = batches(first, 5)
    first._position = {"epoch": 0, "prompts": 4}
    second = RLVRDataModule(batch_size=2, num_train=20, num_test=2, seed=3)
    second.setup("fit")
    second.load_state_dict(first.state_dict())
    assert batches(second, 3) == whole[2:5]


def test_a_resume_with_another_batch_size_continues_after_the_prompts_trained_on():
    """Issue 61, class 9: the position is kept in prompts, so `data.batch_size=4` resuming a run of 8 starts at the
    17th prompt after two steps, not at the 9th (two batches of the new size)."""
    from lit_rlvr.data.datamodule import RLVRDataModule

    def prompts(dm, n):
        it = iter(dm.train_dataloader())
        return [p for _ in range(n) for p in next(it)["prompt"]]

    first = RLVRDataModule(batch_size=8, num_train=40, num_test=2, seed=3)
    first.setup("fit")
    first.note_batches(1)
    first.note_batches(1)
    second = RLVRDataModule(batch_size=4, num_train=40, num_test=2, seed=3)
    second.setup("fit")
    second.load_state_dict(first.state_dict())
    whole = RLVRDataModule(batch_size=4, num_train=40, num_test=2, seed=3)
    whole.setup("fit")
    assert prompts(second, 3) == prompts(whole, 7)[16:28]
    old = RLVRDataModule(batch_size=4, num_train=40, num_test=2, seed=3)  # a checkpoint that counted batches
    old.setup("fit")
    old.load_state_dict({"epoch": 0, "batches": 2})
    assert old.state_dict() == {"epoch": 0, "prompts": 8, "batch_size": 4}
