"""docs/environments.md's "write your own environment" command, run as written (2 short steps), and its class."""

import csv
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHORT = ["trainer.max_steps=2", "data.batch_size=4", "data.num_test=8", "callbacks.progress=null",
         "callbacks.completions.every_n_steps=1"]


def docs_command() -> list[str]:
    text = (REPO / "docs" / "environments.md").read_text()
    block = text[text.index("Run it on the default task"):]
    block = block[block.index("```bash\n") + 8:]
    return shlex.split(block[: block.index("\n```")].replace("\\\n", " "))


def test_the_example_environment_hints_then_scores():
    from examples.environments.digit_hint import DigitHintEnv
    from lit_rlvr.data.tasks.arithmetic import arithmetic_reward

    env = DigitHintEnv({"reward": arithmetic_reward, "bonus": 0.5}, {"reward_spec": {"ground_truth": 47},
                                                                       "prompt": "40+7=", "max_turns": 2})
    first = env.step("46")
    assert not first["done"] and first["observations"] == "\nNo. It ends in 7.\n"
    assert env.step("47") == {"observations": "", "reward": 0.5, "done": True, "metadata": {"malformed": False}}


def test_the_docs_command_runs_and_takes_more_than_one_turn(tmp_path):
    command = docs_command()
    assert command[:2] == ["python", "train.py"]
    done = subprocess.run([sys.executable, *command[1:], *SHORT, f"hydra.run.dir={tmp_path}"], cwd=REPO,
                          env=os.environ.copy(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in csv.DictReader((tmp_path / "metrics.csv").open()) if r.get("loss/policy")]  # RL steps
    assert len(rows) == 2 and all(float(r["env/turns_mean"]) > 1 for r in rows)
    lines = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert any(t["role"] == "observation" and "It ends in" in t["text"] for line in lines for t in line["turns"])
