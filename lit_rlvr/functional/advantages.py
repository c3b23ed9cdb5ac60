"""Group-relative advantages (GRPO, Dr. GRPO) over a flat batch of completions.

Completions are flat ([N]) with `group` ([N] long in [0, B)) naming their prompt, so groups may differ in size
(V0.5 gives prompts different sample counts).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lit_rlvr.functional.prompt_history import dbb_advantages


def group_mean(values: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """Mean of `values` ([N]) within each group -> [B] (0 for an empty group)."""
    sums = values.new_zeros(num_groups).index_add_(0, group, values)  # [B]
    counts = torch.bincount(group, minlength=num_groups).to(values.dtype)  # [B]
    return sums / counts.clamp_min(1)


def group_std(values: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """Unbiased standard deviation within each group -> [B] (0 for groups of one), as torch.std."""
    mean = group_mean(values, group, num_groups)  # [B]
    sq = values.new_zeros(num_groups).index_add_(0, group, (values - mean[group]) ** 2)  # [B]
    counts = torch.bincount(group, minlength=num_groups).to(values.dtype)  # [B]
    return (sq / (counts - 1).clamp_min(1)).sqrt()


def constant_groups(rewards: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """[B] bool: groups that have completions and whose rewards are all equal (zero advantage, no signal).

    DAPO's dynamic sampling (Yu et al. 2025, Eq. 11: keep groups with 0 < #correct < G) drops these groups.
    """
    fill = rewards.new_zeros(num_groups)
    high = fill.scatter_reduce(0, group, rewards, reduce="amax", include_self=False)  # [B]
    low = fill.scatter_reduce(0, group, rewards, reduce="amin", include_self=False)  # [B]
    present = torch.bincount(group, minlength=num_groups) > 0  # [B]
    return present & (high == low)


def grpo_advantages(
    rewards: Tensor,
    group: Tensor,
    num_groups: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    baseline: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group-relative advantage of each completion.

    GRPO (Shao et al. 2024, DeepSeekMath, Eq. 3 outcome supervision): A_i = (r_i − mean_g r) / (std_g r + eps).
    Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): `scale_by_std=False`, A_i = r_i − mean_g r.
    A given `baseline` ([B], e.g. the V0.5 fused baseline) replaces the group mean.

    Args:
        rewards: [N] float. group: [N] long. baseline: optional [B].
    Returns:
        advantages [N], metrics with `groups/zero_adv_frac` (groups whose advantages are all 0: around the group
        mean, the groups whose rewards are all equal).
    """
    std = group_std(rewards, group, num_groups)  # [B]
    center = group_mean(rewards, group, num_groups) if baseline is None else baseline.to(rewards.dtype)  # [B]
    adv = rewards - center[group]  # [N]
    if scale_by_std:
        # a group whose rewards are all equal has no spread to scale by: its advantages stay r − b (0 around the
        # group mean; around a given baseline, dividing by eps alone would blow them up a millionfold)
        adv = adv / torch.where(std > 0, std + eps, 1.0)[group]  # [N]
    present = torch.bincount(group, minlength=num_groups) > 0  # [B]
    magnitude = adv.abs()  # [N]
    largest = magnitude.new_zeros(num_groups).scatter_reduce(0, group, magnitude, reduce="amax")  # [B]
    zero = (largest == 0) & present  # [B] groups that give no gradient
    metrics = {"groups/zero_adv_frac": (zero.sum() / present.sum().clamp_min(1)).detach()}
    return adv, metrics


def dr_grpo_advantages(
    rewards: Tensor,
    group: Tensor,
    num_groups: int,
    *,
    scale_by_std: bool = False,
    baseline: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783, §3.2): A_i = r_i − mean_g r, without GRPO's division by
    std_g r (which up-weights prompts that are too easy or too hard). `scale_by_std` is in the signature of every
    advantage and must be False here (True contradicts the method: a ValueError, not ignored)."""
    if scale_by_std:
        raise ValueError("scale_by_std=True: Dr. GRPO's advantage has no std division; use grpo_advantages")
    return grpo_advantages(rewards, group, num_groups, scale_by_std=False, baseline=baseline)


# the advantages `algorithm.advantages` chooses from (DBB's: a prompt's history as the baseline,
# functional/prompt_history.py); one signature: (rewards, group, num_groups, *, scale_by_std,
# baseline) -> (advantages, metrics)
ADVANTAGES = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "dbb": dbb_advantages}
# what DAPO's dynamic sampling compares within a group (verl's `algorithm.filter_groups.metric`)
GROUP_FILTER_METRICS = ("acc", "score")


def informative_groups(rewards: Tensor, group: Tensor, num_groups: int, *, metric: str = "acc") -> Tensor:
    """[B] bool: groups whose `metric` differs between completions (DAPO, Yu et al. 2025, Eq. 11:
    0 < #correct < G). `acc`: correctness (reward > 0); `score`: the reward itself. Empty groups are kept."""
    if metric not in GROUP_FILTER_METRICS:
        raise ValueError(f"metric={metric!r}; valid: {', '.join(GROUP_FILTER_METRICS)}")
    values = (rewards > 0).to(rewards.dtype) if metric == "acc" else rewards  # [N]
    return ~constant_groups(values, group, num_groups)
