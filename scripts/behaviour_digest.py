"""Digests of short runs, to check that a refactoring leaves behaviour bit for bit unchanged (issue 22).

Runs `python train.py` for each named configuration of CONFIGS (grpo, dapo, dr_grpo, gspo, c3po, v05, c3po_v05,
LoRA, `env=retry`, the rollout correction, async rollouts at staleness 0 and 1; 10 steps, seed 0, small batches)
in a temporary folder and prints one SHA-256 per run of `metrics.csv` and `summary.json`, with what differs between
two runs of the same code removed:
  * metrics.csv: the columns `time/*` and `perf/*` (wall-clock timings and tokens per second) and the async
    shares computed from timings (`async/trainer_wait_frac`, `async/engine_idle_frac`);
  * summary.json: keys ending in `_s` or `_seconds` (wall-clock timings), `peak_rss_mb` (the process's peak
    memory, which varies from run to run), and `run_dir`, `checkpoint`, `paths`, `date`, `started`, `finished`
    (paths and dates) where present.
Every other value is hashed as written. Usage: `nice python scripts/behaviour_digest.py [--jobs 2] [NAME ...]`;
`--drop-columns micro/` also leaves out metric columns a change added (to compare across it).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {  # name -> train.py overrides
    **{a: (f"algorithm={a}",) for a in ("grpo", "dapo", "dr_grpo", "gspo", "c3po", "v05", "c3po_v05")},
    "lora": ("algorithm=grpo", "model.lora.rank=4"),
    "c3po_lora": ("algorithm=c3po", "model.lora.rank=4"),
    "retry": ("algorithm=grpo", "env=retry"),
    "rollout_is": ("algorithm=grpo", "algorithm.rollout_correction.rollout_is=token",
                   "algorithm.rollout_correction.rollout_rs=sequence"),
    "async_s0": ("algorithm=grpo", "rollout.mode=async", "rollout.max_staleness=0"),
    "async_s1": ("algorithm=grpo", "rollout.mode=async", "rollout.max_staleness=1"),
}
OVERRIDES = ("seed=0", "trainer.max_steps=10", "data.batch_size=4", "data.num_test=4", "callbacks.progress=null",
             "checkpoint_every=100")
# wall-clock timings, and the async shares computed from them
DROP_COLUMN_PREFIXES = ("time/", "perf/", "async/trainer_wait_frac", "async/engine_idle_frac")
DROP_KEYS = {"peak_rss_mb", "run_dir", "checkpoint", "paths", "date", "started", "finished"}


def metrics_digest(path: Path, drop: tuple[str, ...] = ()) -> str:
    rows = list(csv.DictReader(path.open()))
    keep = sorted(k for k in (rows[0] if rows else {}) if not k.startswith(DROP_COLUMN_PREFIXES + drop))
    text = "\n".join(",".join(f"{k}={r.get(k, '')}" for k in keep) for r in rows)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def summary_digest(path: Path) -> str:
    summary = json.loads(path.read_text())
    kept = {k: v for k, v in summary.items() if k not in DROP_KEYS and not k.endswith(("_s", "_seconds"))}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def run(name: str, root: Path, drop: tuple[str, ...]) -> str:
    run_dir = root / name
    proc = subprocess.run([sys.executable, "train.py", *CONFIGS[name], f"hydra.run.dir={run_dir}", *OVERRIDES],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{name:10s} FAILED rc={proc.returncode}: {proc.stderr[-2000:]}"
    return (f"{name:10s} metrics.csv {metrics_digest(run_dir / 'metrics.csv', drop)}  "
            f"summary.json {summary_digest(run_dir / 'summary.json')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(CONFIGS), metavar="NAME", help=", ".join(CONFIGS))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--keep", help="write the runs here instead of a temporary folder")
    parser.add_argument("--drop-columns", action="append", default=[], metavar="PREFIX",
                        help="also leave out metrics.csv columns starting with PREFIX (repeatable)")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    with tempfile.TemporaryDirectory(prefix="digest-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        with ThreadPoolExecutor(args.jobs) as pool:
            for line in pool.map(lambda a: run(a, root, tuple(args.drop_columns)), args.names):
                print(line, flush=True)


if __name__ == "__main__":
    main()
