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
