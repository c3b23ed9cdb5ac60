"""`ValidationMetrics` across Lightning's two evaluation contexts: `trainer.validate` (the default
`eval_before=true`) runs under inference mode, validation inside `fit` (epoch ends, a signal's stop) under
no_grad. States reset in the first must take updates in the second (issue 19: the run crashed at an epoch end)."""

import torch

from lit_rlvr.run.validation import ValidationMetrics


def test_states_reset_under_inference_mode_take_updates_under_no_grad():
    metrics = ValidationMetrics(num_samples=2)
    with torch.inference_mode():  # trainer.validate before training
        metrics.update(torch.tensor([[True, False], [False, False]]))
        metrics.compute()
        metrics.reset()
    with torch.no_grad():  # validation at an epoch end inside fit
        metrics.update(torch.tensor([[True, True], [True, False]]))
    values = metrics.compute()
    assert values["val/accuracy"].item() == 0.75 and values["val/pass@k"].item() == 1.0
    with torch.inference_mode():  # and the evaluation after training
        metrics.reset()
        metrics.update(torch.tensor([[False, False]]))
        assert metrics.compute()["val/accuracy"].item() == 0.0


def test_pass_at_k_ladder_by_hand():
    """n = 4: pass@2 as well as pass@4. One correct of 4: pass@2 = 1 − C(3,2)/C(4,2) = 1/2; two of 4: 1 − 1/6."""
    metrics = ValidationMetrics(num_samples=4)
    metrics.update(torch.tensor([[True, False, False, False], [True, True, False, False]]))
    values = metrics.compute()
    assert set(values) == {"val/accuracy", "val/mean@k", "val/pass@k", "val/pass@2"}
    assert abs(values["val/pass@2"].item() - (0.5 + 5 / 6) / 2) < 1e-6
    assert values["val/pass@k"].item() == 1.0
    metrics.reset()
    assert set(ValidationMetrics(num_samples=16).compute()) >= {"val/pass@2", "val/pass@4", "val/pass@8"}
    assert "val/pass@2" not in ValidationMetrics(num_samples=2).compute()
