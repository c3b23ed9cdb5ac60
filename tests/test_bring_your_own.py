"""README's "Bring your own" command, run as written (with the tiny model's folder as $MODEL_DIR, 2 steps):
a local model folder, a reward function from a file, a JSONL file with its own column names and an eval file.
Without data.eval_path the run says, in one line, that it evaluates on the training file."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from lit_rlvr.rewards import RewardResult, resolve_reward

REPO = Path(__file__).resolve().parents[1]
SHORT = ["trainer.max_steps=2", "data.batch_size=4", "callbacks.progress=null"]


def readme_command() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text[text.index("### Bring your own"):]
    block = block[block.index("```bash\n") + 8:]
    block = block[: block.index("\n```")]
    return shlex.split(block.replace("\\\n", " "))


def _run(command: list[str], model_dir: str, run_dir: Path) -> subprocess.CompletedProcess:
    args = [a.replace("$MODEL_DIR", model_dir) for a in command[1:]]
    done = subprocess.run([sys.executable, *args, *SHORT, f"hydra.run.dir={run_dir}"], cwd=REPO,
                          env=os.environ.copy(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_example_reward():
    fn = resolve_reward("examples.bring_your_own.reward:close_enough")
    assert fn("2+2=", "4", "4") == RewardResult(1.0, False)
    assert fn("2+2=", "5", "4").score == 0.0 and fn("2+2=", "9", "4").score == -1.0
    assert fn("2+2=", "four", "4").malformed


def test_readme_command_runs(tiny_path, tmp_path):
    command = readme_command()
    assert command[:2] == ["python", "train.py"] and "$MODEL_DIR" in " ".join(command)
    done = _run(command, tiny_path, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["accuracy_after"] is not None
    assert "uses the training file" not in done.stdout + done.stderr


def test_without_eval_path_says_it_evaluates_on_training_file(tiny_path, tmp_path):
    command = [a for a in readme_command() if not a.startswith("data.eval_path=")]
    done = _run(command + ["eval_before=false"], tiny_path, tmp_path / "run")
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "uses the training file" in line]
    assert len(lines) == 1 and "examples/bring_your_own/train.jsonl" in lines[0]
