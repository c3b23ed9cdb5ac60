"""Token-budget micro-batches (`algorithm.micro_batch_tokens`, verl's dynamic batch size): the partition
(functional.micro_batches) and the update loop that uses it. The loss and gradient equal the fixed-size
micro-batches' for every aggregation, with and without 3PO's sequence mask, as tests/test_micro_batches.py
checks for the fixed sizes."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.functional.losses import AGGREGATIONS
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.update import forward_logprobs
from tiny_options import TINY as TINY_OPTIONS

TINY = {"cache_dir": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr"), **TINY_OPTIONS}


def test_rows_are_grouped_by_length_within_the_budget():
    """Hand-worked: lengths 5 1 4 2 3 6, budget 10 -> longest first: [6] (2·6 > 10), [5, 4] (2·5 = 10),
    [3, 2, 1] (3·3 = 9); padded 6 + 10 + 9 = 25 positions for 21 tokens."""
    lengths = torch.tensor([5, 1, 4, 2, 3, 6])
    micros, metrics = F.micro_batches(lengths, max_rows=64, max_tokens=10)
    assert [m.tolist() for m in micros] == [[5], [0, 2], [4, 3, 1]]
    assert float(metrics["micro/count"]) == 3
    assert float(metrics["micro/padding_frac"]) == pytest.approx(1 - 21 / 25)


def test_row_cap_and_a_row_longer_than_the_budget():
    lengths = torch.tensor([2, 2, 2, 2, 2, 50])
    micros, _ = F.micro_batches(lengths, max_rows=2, max_tokens=20)
    assert [m.tolist() for m in micros] == [[5], [0, 1], [2, 3], [4]]  # 50 > 20 alone; then 2 rows at most


def test_fixed_split_when_off():
    micros, _ = F.micro_batches(torch.tensor([3, 1, 2, 5, 4]), max_rows=2)
    assert [m.tolist() for m in micros] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_and_each_micro_batch_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (64,), generator=g)
    budget = 600
    micros, metrics = F.micro_batches(lengths, max_rows=16, max_tokens=budget)
    assert sorted(torch.cat(micros).tolist()) == list(range(64))
    for m in micros:
        assert len(m) <= 16 and (len(m) == 1 or len(m) * int(lengths[m].max()) <= budget)
    for earlier, later in zip(micros, micros[1:]):  # grouped by length: no row of a later one is longer
        assert int(lengths[later].max()) <= int(lengths[earlier].min())
    fixed, fixed_metrics = F.micro_batches(lengths, max_rows=16)
    assert float(metrics["micro/padding_frac"]) < float(fixed_metrics["micro/padding_frac"])


def _rollouts(module: GRPOModule) -> Rollouts:
    """10 completions of 2 prompts: prompts of 3–7 tokens left-padded to 8, responses of 1–9 tokens
    right-padded to 12 (columns no row uses, which the token-budget path trims). Behaviour log-probs are the
    policy's own moved by 0.02 per token, by 1.0 for completions 1 and 6 (outside [1/2, 2]: dropped by τ = 2)."""
    g = torch.Generator().manual_seed(0)
    n, p, t = 10, 8, 12
    prompt_lengths = torch.tensor([3, 7, 5, 4, 6, 3, 7, 5, 4, 6])
    lengths = torch.tensor([1, 9, 3, 4, 2, 5, 8, 3, 7, 6])
    rollouts = Rollouts(
        prompt_ids=torch.randint(4, 90, (n, p), generator=g),
        prompt_mask=torch.arange(p).flip(0) < prompt_lengths[:, None],
        response_ids=torch.randint(4, 90, (n, t), generator=g), response_mask=torch.arange(t) < lengths[:, None],
        old_logp=torch.zeros(n, t), group=torch.arange(n) // 5, source=torch.zeros(n, dtype=torch.long),
        num_groups=2, prompts=["a", "b"], answers=[0, 0], advantages=torch.randn(n, generator=g))
    rollouts.prompt_ids = rollouts.prompt_ids.masked_fill(~rollouts.prompt_mask, 0)  # the pad id
    with torch.no_grad():
        logp, _ = forward_logprobs(module.policy, rollouts, temperature=module.algorithm.temperature)  # [n, t]
    shift = torch.full((n, 1), 0.02)
    shift[[1, 6]] = 1.0
    rollouts.old_logp = (logp - shift) * rollouts.response_mask
    return rollouts


def _pass(module: GRPOModule, rollouts: Rollouts, size: int, tokens) -> tuple[torch.Tensor, dict]:
    module.algorithm = replace(module.algorithm, micro_batch_size=size, micro_batch_tokens=tokens)
    module.policy.zero_grad()
    sums: dict = {}
    module.make_update().backward_pass(rollouts, 0, sums)  # no trainer: plain autograd
    grad = torch.cat([q.grad.flatten() for q in module.policy.parameters() if q.grad is not None])
    return grad, {k: float(v) for k, v in sums.items() if not k.startswith("micro/")}


@pytest.mark.parametrize("tau", [None, 2.0])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradient_equals_the_fixed_micro_batches(aggregation, tau):
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=5, max_new_tokens=12,
                        loss_aggregation=aggregation, entropy_coef=0.01, seq_mask_tau=tau)
    rollouts = _rollouts(module)
    want, want_metrics = _pass(module, rollouts, 10, None)  # one fixed micro-batch: the whole pass
    for size, tokens in ((64, 40), (3, 40), (64, 17), (64, 1)):  # budget 1: one row per micro-batch
        grad, metrics = _pass(module, rollouts, size, tokens)
        # float32 in another order (narrower forwards, other sums): measured ~1e-6 of the norm; a micro-batch
        # weighted wrongly (e.g. all equally) moves it by ~0.2
        assert float((grad - want).norm()) <= 1e-5 * float(want.norm())
        assert metrics == pytest.approx(want_metrics, rel=1e-5, abs=1e-7)


def test_update_loop_forwards_the_grouped_trimmed_micro_batches():
    """What the forwards receive: the partition of functional.micro_batches, each trimmed to its own longest
    prompt and response (the point of the option), and the micro-batch metrics in the pass's sums."""
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=5, max_new_tokens=12)
    rollouts = _rollouts(module)
    module.algorithm = replace(module.algorithm, micro_batch_tokens=40)
    update = module.make_update()
    seen = []
    real = update.micro_batch_loss
    update.micro_batch_loss = lambda part, weight: seen.append(part) or real(part, weight)
    sums: dict = {}
    update.backward_pass(rollouts, 0, sums)
    lengths = rollouts.prompt_mask.sum(-1) + rollouts.response_mask.sum(-1)
    micros, metrics = F.micro_batches(lengths, max_rows=64, max_tokens=40)
    assert len(seen) == len(micros) > 1
    for part, micro in zip(seen, micros):
        assert torch.equal(part.response_ids, rollouts.response_ids[micro][:, : part.response_ids.shape[1]])
        assert part.response_ids.shape[1] == int(rollouts.response_mask[micro].sum(-1).max())
        assert part.prompt_ids.shape[1] == int(rollouts.prompt_mask[micro].sum(-1).max())
    assert float(sums["micro/padding_frac"]) == pytest.approx(float(metrics["micro/padding_frac"]))


def test_bad_budget_names_the_key():
    with pytest.raises(ValueError, match=r"algorithm.micro_batch_tokens=0 is not valid: expected an integer >= 1"):
        GRPOModule(model="tiny", model_options=dict(TINY), micro_batch_tokens=0)


def test_padding_share_of_untrimmed_fixed_micro_batches_counts_the_full_width():
    lengths = torch.tensor([3, 1])
    _, metrics = F.micro_batches(lengths, max_rows=2, width=5)
    assert float(metrics["micro/padding_frac"]) == pytest.approx(1 - 4 / 10)
