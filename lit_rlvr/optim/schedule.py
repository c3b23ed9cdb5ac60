"""Learning-rate schedules, as multipliers of the base lr for `torch.optim.lr_scheduler.LambdaLR`."""

from __future__ import annotations


def warmup_factor(step: int, *, warmup_steps: int, from_zero: bool = False) -> float:
    """Linear warm-up to a constant lr; `step` k counts optimizer updates from 0, W = `warmup_steps`.

    default:    f(k) = min(1, (k + 1) / (W + 1)): the first update takes lr / (W + 1), update W the full lr.
    from_zero:  f(k) = k / W for k < W, else 1: verl's constant schedule with warm-up (`lr_warmup_steps`), whose
                first update takes lr 0 (for IVON that update still moves the Hessian, not the mean).
    W = 0 is no warm-up either way.
    """
    if warmup_steps <= 0:
        return 1.0
    if from_zero:
        return min(1.0, step / warmup_steps)
    return min(1.0, (step + 1) / (warmup_steps + 1))
