"""Warnings a `train.py` run would print that do not apply to it, each silenced with the reason.

`install()` is called by the entry before any work; everything else Lightning, torch or
transformers say is left as is.
"""

from __future__ import annotations

import warnings

REASONS = {
    # RunCheckpoint stores the sampler's position with the run's state (tests/test_resume.py: bit-for-bit resume);
    # Lightning only knows about dataloaders with their own state_dict
    r".*your dataloader is not resumable.*": "the sampler's position is in last.ckpt",
    # Lightning's own pytree helper on torch >= 2.10: nothing for a user to change
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*": "Lightning internals",
    # CSVLogger says so whenever its dir has any file (Hydra's .hydra/ folder is enough); a run dir that holds an
    # earlier run's metrics.csv is refused unless the run resumes it, which sets the rows aside and merges them back
    r".*Previous log files in this directory will be deleted.*": "nothing is deleted (lit_rlvr/run/run_lock.py)",
}


def install() -> None:
    for pattern in REASONS:
        warnings.filterwarnings("ignore", message=pattern)
