"""`CompletionsLog`: every N RL steps, a sample of what the model wrote, to read beside the metrics.

Each sampled completion becomes one JSON line of `completions.jsonl` in the run dir (step, prompt, completion,
answer, reward, advantage, length in tokens, finish reason, malformed; for multi-turn rollouts also `turns`, each
{"role": "assistant" | "observation", "text": ...}, `tool_calls`, `env_error` and `cut`) and one row of a table for
the loggers that draw tables: `WandbLogger.log_table` ("completions"), TensorBoard's text tab (a markdown table).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.problems import convert, problem_line
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.run.step_count import rl_step
from lit_rlvr.run.storage import append_text, writing

COLUMNS = ["step", "prompt", "completion", "answer", "reward", "advantage", "length", "finish_reason", "malformed"]
KEY = "callbacks.completions"  # its key in conf/config.yaml


class CompletionsLog(RLVRCallback):
    """`every_n_steps` RL steps (0 = off), `samples` completions drawn at random (seeded by the step) from the
    step's rollouts on rank 0; `path` defaults to `<trainer.default_root_dir>/completions.jsonl`."""

    def __init__(self, every_n_steps: int = 10, samples: int = 8, path: Optional[str] = None, seed: int = 0):
        every_n_steps, samples = convert(f"{KEY}.every_n_steps", every_n_steps, int), convert(f"{KEY}.samples",
                                                                                               samples, int)
        ConfigError.check([problem_line(f"{KEY}.{name}", value, f"an integer >= {low}") for name, value, low in
                           (("every_n_steps", every_n_steps, 0), ("samples", samples, 1)) if value < low])
        self.every_n_steps, self.samples, self.path, self.seed = every_n_steps, samples, path, seed

    def on_rl_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rollouts: Rollouts) -> None:
        step = rl_step(trainer)  # this RL step, as metrics.csv counts
        if self.every_n_steps and step % self.every_n_steps == 0:
            self._write(trainer, step, rows(rollouts, step, self.samples, self.seed))

    @rank_zero_only
    def _write(self, trainer: pl.Trainer, step: int, records: list[dict[str, Any]]) -> None:
        path = Path(self.path or Path(trainer.default_root_dir) / "completions.jsonl")
        with writing(path, "the completions log"):
            path.parent.mkdir(parents=True, exist_ok=True)
        # a failed append is cut off again: the file keeps whole lines only
        append_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), "the completions log")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table("completions", columns=COLUMNS, data=[[r[c] for c in COLUMNS] for r in records])
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("completions", markdown(records), global_step=step)


def rows(rollouts: Rollouts, step: int, samples: int, seed: int = 0) -> list[dict[str, Any]]:
    """`samples` of the step's completions as dicts of `COLUMNS`, in rollout order."""
    n = rollouts.num_samples
    picked = sorted(random.Random(f"{seed}:{step}").sample(range(n), min(samples, n)))
    lengths = rollouts.response_mask.sum(-1).tolist()
    out = []
    for i in picked:
        g = int(rollouts.group[i])
        out.append({
            "step": step,
            "prompt": rollouts.prompts[g] if isinstance(rollouts.prompts[g], str) else str(rollouts.prompts[g]),
            "completion": rollouts.completions[i] if rollouts.completions else "",
            "answer": str(rollouts.answers[g]),
            "reward": float(rollouts.rewards[i]),
            "advantage": float(rollouts.advantages[i]) if rollouts.advantages is not None else None,
            "length": int(lengths[i]),
            "finish_reason": rollouts.finish_reason[i] if rollouts.finish_reason else None,
            "malformed": bool(rollouts.malformed[i]) if rollouts.malformed is not None else None,
        })
        if rollouts.transcripts:  # multi-turn: the turns with their roles
            t = rollouts.transcripts[i].to_dict()
            out[-1].update(turns=t["turns"], tool_calls=t["tool_calls"], env_error=t["error"], cut=t["cut"])
    return out


def markdown(records: list[dict[str, Any]]) -> str:
    """A markdown table (TensorBoard renders text as markdown); `|` and newlines in texts escaped."""
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "⏎")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in records]
    return "\n".join(lines)
