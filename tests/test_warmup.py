"""The tiny model's cached warm-up (lit_rlvr.models.warmup)."""

import torch

from lit_rlvr.models.warmup import warm_start_tiny


def test_warm_up_leaves_the_callers_rng_alone(tmp_path):
    """A cold cache trains the model; the caller's random numbers must not depend on whether it did."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    path = warm_start_tiny(tmp_path, steps=2, batch_size=4)
    assert torch.equal(torch.get_rng_state(), before)
    assert (path / "config.json").exists() and not list(tmp_path.glob("*.tmp-*"))
    assert warm_start_tiny(tmp_path, steps=2, batch_size=4) == path  # warm: the same folder, nothing trained


def _warm_up_slowly(cache: str, marks: str) -> str:
    """A rank's warm-up on a cold cache; each training leaves a mark, and takes long enough to overlap."""
    import os
    import time
    from pathlib import Path

    from lit_rlvr.models import warmup

    train = warmup._train

    def marked_train(*args, **kwargs):
        (Path(marks) / str(os.getpid())).touch()
        time.sleep(1.0)
        return train(*args, **kwargs)

    warmup._train = marked_train
    return str(warmup.warm_start_tiny(cache, steps=2, batch_size=4))


def test_ranks_warming_up_at_once_train_once(tmp_path):
    """Two processes ask for the same cold cache entry together: one trains, the other waits and loads it."""
    import multiprocessing

    marks = tmp_path / "marks"
    marks.mkdir()
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.starmap(_warm_up_slowly, [(str(tmp_path / "cache"), str(marks))] * 2)
    assert paths[0] == paths[1]
    assert len(list(marks.iterdir())) == 1
