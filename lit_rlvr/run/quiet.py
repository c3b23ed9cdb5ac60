"""Warnings a `train.py` run would print that do not apply to it, each silenced with the reason.

`install(run_dir, resume)` is called by the entry before any work; everything else Lightning, torch or
transformers say is left as is.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

REASONS = {
    # RunCheckpoint stores the sampler's position with the run's state (tests/test_resume.py: bit-for-bit resume);
    # Lightning only knows about dataloaders with their own state_dict
    r".*your dataloader is not resumable.*": "the sampler's position is in last.ckpt",
    # Lightning's own pytree helper on torch >= 2.10: nothing for a user to change
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*": "Lightning internals",
}
# CSVLogger says so whenever its dir has any file (Hydra's .hydra/ folder is enough); it only matters when a
# metrics.csv is there and the run does not resume (a resume sets the rows aside and merges them back)
OVERWRITE = r".*Previous log files in this directory will be deleted.*"


def install(run_dir: Optional[Path] = None, resume: Optional[str] = None) -> None:
    for pattern in REASONS:
        warnings.filterwarnings("ignore", message=pattern)
    if run_dir is None or resume is not None or not (Path(run_dir) / "metrics.csv").exists():
        warnings.filterwarnings("ignore", message=OVERWRITE)
