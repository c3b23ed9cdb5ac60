"""What a user sees of a run: completions.jsonl and the loggers' completion tables, a summary.json that any
JSON reader takes (null, not NaN), one meaning of "step" (RL steps, as metrics.csv and the report count them;
optimizer steps apart), and no warning that does not apply (weights_only, log files deleted on a fresh run,
"dataloader is not resumable" on an exact resume, "Epoch 0/-2")."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
NOISE = ("weights_only", "Previous log files", "not resumable", "/-2", "LeafSpec")
SMALL = ["algorithm=gspo", "data.batch_size=4", "data.num_test=8", "checkpoint_every=1", "logger=tensorboard",
         "callbacks.completions.every_n_steps=1", "callbacks.completions.samples=3"]


def _run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=REPO, env=os.environ.copy(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _strict_json(path: Path) -> dict:
    def refuse(name):
        raise ValueError(f"{path} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """GSPO (2 mini-batches: 2 optimizer steps per RL step): 2 RL steps, then resumed to 3."""
    run_dir = tmp_path_factory.mktemp("gspo") / "run"
    first = _run(run_dir, "trainer.max_steps=4")
    first_summary = _strict_json(run_dir / "summary.json")
    second = _run(run_dir, "trainer.max_steps=6", f"resume={run_dir}/checkpoints/last.ckpt")
    return run_dir, first, second, first_summary


def test_no_noise(resumed):
    _, first, second, _ = resumed
    for done in (first, second):
        for text in NOISE:
            assert text not in done.stdout + done.stderr, text


def test_summary_is_json_and_counts_rl_steps(resumed):
    run_dir, _, _, first = resumed
    assert first["steps"] == 2 and first["optimizer_steps"] == 4
    summary = _strict_json(run_dir / "summary.json")
    assert summary["accuracy_before"] is None  # a resume does not evaluate before: null, not NaN
    with (run_dir / "metrics.csv").open() as handle:
        steps = {int(r["step"]) for r in csv.DictReader(handle) if r.get("reward/mean")}
    assert summary["steps"] == len(steps) == 3 and summary["optimizer_steps"] == 6


def test_completions_written_each_step(resumed):
    run_dir, *_ = resumed
    rows = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 3 + [1] * 3 + [2] * 3
    keys = {"step", "prompt", "completion", "answer", "reward", "advantage", "length", "finish_reason", "malformed"}
    assert all(set(r) == keys for r in rows)
    assert all(isinstance(r["reward"], float) and isinstance(r["advantage"], float) for r in rows)


def test_completions_in_tensorboard(resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, *_ = resumed
    events = EventAccumulator(str(next(run_dir.rglob("events.out.tfevents.*")).parent)).Reload()
    assert any("completions" in tag for tag in events.Tags()["tensors"])


def _rollouts():
    from lit_rlvr.rollout.batch import Rollouts

    n = 4
    return Rollouts(prompt_ids=torch.zeros(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
                    response_ids=torch.zeros(n, 3, dtype=torch.long),
                    response_mask=torch.tensor([[1, 1, 0]] * n, dtype=torch.bool), old_logp=torch.zeros(n, 3),
                    group=torch.tensor([0, 0, 1, 1]), source=torch.zeros(n, dtype=torch.long), num_groups=2,
                    prompts=["1+1=", "2+2="], answers=["2", "4"], completions=["2", "3", "4", "4|x"],
                    finish_reason=["stop"] * n, rewards=torch.tensor([1.0, -1.0, 1.0, 1.0]),
                    malformed=torch.zeros(n, dtype=torch.bool), advantages=torch.tensor([0.7, -0.7, 0.0, 0.0]))


def test_rows_pair_each_completion_with_its_prompt():
    from lit_rlvr.callbacks.completions_log import markdown, rows

    out = rows(_rollouts(), step=5, samples=4)
    assert [(r["prompt"], r["completion"], r["reward"], r["advantage"], r["length"]) for r in out] == [
        ("1+1=", "2", 1.0, pytest.approx(0.7), 2), ("1+1=", "3", -1.0, pytest.approx(-0.7), 2),
        ("2+2=", "4", 1.0, 0.0, 2), ("2+2=", "4|x", 1.0, 0.0, 2)]
    assert "4\\|x" in markdown(out)  # a | in a completion does not break the table


def test_wandb_gets_a_table(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    from lit_rlvr.callbacks import CompletionsLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(save_dir=str(tmp_path), project="t")
    trainer = SimpleNamespace(loggers=[logger], default_root_dir=str(tmp_path))
    CompletionsLog(every_n_steps=1, samples=2)._write(trainer, 0, [dict.fromkeys(
        ["step", "prompt", "completion", "answer", "reward", "advantage", "length", "finish_reason", "malformed"], 1)])
    logger.experiment.finish()
    assert list(tmp_path.rglob("completions_*.table.json"))
    assert len((tmp_path / "completions.jsonl").read_text().splitlines()) == 1


def test_progress_bar_counts_steps_not_epochs():
    from lit_rlvr.run.progress import RLProgressBar

    bar = RLProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1, max_steps=250)
    assert "-2" not in bar._get_train_description(0) and "max_steps=250" in bar._get_train_description(0)
    assert "RLProgressBar" in (REPO / "conf" / "config.yaml").read_text()


def test_progress_bar_counts_updates_not_the_calls_that_fill_the_async_pipeline():
    """Issue 61 (minor): with S = 64 the bar read `66/2` at the second update; it shows 2/2."""
    from lit_rlvr.run.progress import RLProgressBar

    bar, shown = RLProgressBar(), []
    loop = SimpleNamespace(_batches_that_stepped=0)
    bar._trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop), is_global_zero=True)
    bar._enabled, bar.train_progress_bar_id = False, 0  # nothing drawn: the values it would draw are recorded
    bar._update = lambda bar_id, current, visible=True: shown.append(current)
    bar._update_metrics = lambda trainer, module: None
    bar.on_train_epoch_start(bar.trainer, None)
    for batch_idx in range(66):
        filling = batch_idx < 64
        loop._batches_that_stepped -= filling  # as GRPOModule.training_step does for a call without an update
        bar.on_train_batch_end(bar.trainer, None, None, None, batch_idx)
        loop._batches_that_stepped += 1  # as Lightning does after the hook
    assert shown[63] == 0 and shown[64:] == [1, 2]
