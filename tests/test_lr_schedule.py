"""The learning-rate warm-up (`algorithm.warmup_steps`, `algorithm.warmup_from_zero`) by hand, and as the module
configures it."""

import pytest

from lit_rlvr.module import GRPOModule
from lit_rlvr.optim.schedule import warmup_factor

from tiny_options import TINY


def test_warmup_factor_by_hand():
    # W = 3. Default: (k + 1) / (W + 1), the full lr from update 3 on. verl's constant schedule with warm-up
    # (lr_warmup_steps): k / W, so its first update takes lr 0, also full from update 3 on
    assert [warmup_factor(k, warmup_steps=3) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    verl_shape = [warmup_factor(k, warmup_steps=3, from_zero=True) for k in range(5)]
    assert verl_shape == pytest.approx([0, 1 / 3, 2 / 3, 1, 1])
    assert warmup_factor(0, warmup_steps=0) == warmup_factor(0, warmup_steps=0, from_zero=True) == 1.0  # no warm-up


@pytest.mark.parametrize("from_zero, expected", [(False, [0.025, 0.05, 0.075, 0.1, 0.1]),
                                                 (True, [0.0, 0.1 / 3, 0.2 / 3, 0.1, 0.1])])
def test_module_schedule_steps_the_optimizer_lr(from_zero, expected):
    """What each of the first five optimizer updates runs at (the module steps the scheduler after each update)."""
    module = GRPOModule(model="tiny", model_options=dict(TINY), lr=0.1, warmup_steps=3, warmup_from_zero=from_zero)
    configured = module.configure_optimizers()
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    seen = []
    for _ in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen == pytest.approx(expected)
