"""The update (lit_rlvr.update.Update, as GRPOModule builds it): the weighted micro-batch losses sum to the loss
of the whole batch, so the gradient does not depend on `micro_batch_size` — for every aggregation, with and without
3PO's sequence mask — and `mini_batches` gives exactly that many optimizer steps."""

from __future__ import annotations

from dataclasses import replace

import logging
import os

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.functional.losses import AGGREGATIONS
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.update import forward_logprobs
from tiny_options import TINY as TINY_OPTIONS

TINY = {"cache_dir": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr"), **TINY_OPTIONS}  # = conf/model/tiny.yaml


def _rollouts(module: GRPOModule, tau) -> Rollouts:
    """8 completions of 2 prompts, responses of 1–6 tokens; the behaviour log-probs are the policy's own, moved
    by 0.02 per token, and by 1.0 per token for completions 1 and 6 (their ratio leaves [1/2, 2]: dropped)."""
    g = torch.Generator().manual_seed(0)
    n, p, t = 8, 5, 6
    lengths = torch.tensor([1, 6, 3, 4, 2, 5, 6, 3])
    rollouts = Rollouts(
        prompt_ids=torch.randint(4, 90, (n, p), generator=g), prompt_mask=torch.ones(n, p, dtype=torch.bool),
        response_ids=torch.randint(4, 90, (n, t), generator=g), response_mask=torch.arange(t) < lengths[:, None],
        old_logp=torch.zeros(n, t), group=torch.arange(n) // 4, source=torch.zeros(n, dtype=torch.long),
        num_groups=2, prompts=["a", "b"], answers=[0, 0], advantages=torch.randn(n, generator=g))
    module.algorithm = replace(module.algorithm, seq_mask_tau=tau)
    with torch.no_grad():
        logp, _ = forward_logprobs(module.policy, rollouts, temperature=module.algorithm.temperature)  # [n, t]
    shift = torch.full((n, 1), 0.02)
    shift[[1, 6]] = 1.0
    rollouts.old_logp = (logp - shift) * rollouts.response_mask
    return rollouts


def _grads_and_metrics(module: GRPOModule, tau) -> tuple[list, list]:
    """The gradient and the summed pass metrics at micro-batch sizes 8, 3 and 1."""
    rollouts = _rollouts(module, tau)
    grads, metrics = [], []
    for size in (8, 3, 1):
        module.algorithm = replace(module.algorithm, micro_batch_size=size)
        module.policy.zero_grad()
        sums: dict = {}
        module.make_update().backward_pass(rollouts, 0, sums)  # no trainer: plain autograd
        grads.append(torch.cat([q.grad.flatten() for q in module.policy.parameters() if q.grad is not None]))
        metrics.append({k: float(v) for k, v in sums.items() if not k.startswith("micro/")})  # they describe the split
    return grads, metrics


@pytest.mark.parametrize("tau", [None, 2.0])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradient_does_not_depend_on_micro_batch_size(aggregation, tau):
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=6,
                        loss_aggregation=aggregation, entropy_coef=0.01)
    grads, metrics = _grads_and_metrics(module, tau)
    for grad, got in zip(grads[1:], metrics[1:]):
        # float32 sums in another order; token-sum gradients are up to T times larger, so their rounding is too
        # float sums in another order move near-zero entries by ~1e-7; a wrong micro-batch weight moves them by ~1e-2
        torch.testing.assert_close(grad, grads[0], rtol=1e-5, atol=1e-6)
        assert got == pytest.approx(metrics[0], rel=1e-5, abs=1e-7)
    if tau is not None:
        assert metrics[0]["loss/seq_mask_frac"] == pytest.approx(2 / 8)


def test_dual_clip_reaches_the_loss_and_does_not_depend_on_micro_batch_size():
    """algorithm.dual_clip = 1.5: completions 1 and 6 (ratio e^1 per token) with A < 0 are capped at c·A."""
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=6,
                        loss_aggregation="token-mean", dual_clip=1.5)
    grads, metrics = _grads_and_metrics(module, None)
    assert 0 < metrics[0]["loss/pg_clipfrac_lower"] < 1  # some tokens capped: the option reached the loss
    for grad, got in zip(grads[1:], metrics[1:]):
        torch.testing.assert_close(grad, grads[0], rtol=1e-5, atol=1e-7)
        assert got == pytest.approx(metrics[0], rel=1e-5, abs=1e-7)


def test_k3_cap_reaches_the_kl_penalty(monkeypatch):
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=6, kl_coef=0.1,
                        kl_k3_cap=10.0)
    seen = []
    real = F.kl_penalty
    monkeypatch.setattr(F, "kl_penalty", lambda *a, **k: seen.append(k) or real(*a, **k))
    _grads_and_metrics(module, None)
    assert seen and all(k == {"estimator": "k3", "k3_cap": 10.0} for k in seen)


def test_gspo_sequence_clip_fraction_does_not_depend_on_micro_batch_size():
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=6, policy_loss="gspo",
                        eps_low=3e-4, eps_high=4e-4)
    grads, metrics = _grads_and_metrics(module, None)
    assert 0 < metrics[0]["loss/pg_clipfrac"] < 1  # some sequences clipped: the weighting matters
    for grad, got in zip(grads[1:], metrics[1:]):
        torch.testing.assert_close(grad, grads[0], rtol=1e-5, atol=1e-7)
        assert got == pytest.approx(metrics[0], rel=1e-5, abs=1e-7)


def test_mini_batches_give_exactly_that_many_optimizer_steps(caplog):
    """8 rollouts in 6 mini-batches: 6 steps (torch.chunk would make 4 of 2); in 9 mini-batches: one step per
    rollout, and a warning naming the key."""
    module = GRPOModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=6, mini_batches=6)
    steps = []
    optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    optimizer.step = lambda: steps.append(sum(q.grad is not None for q in module.policy.parameters()))
    rollouts = _rollouts(module, None)
    module.make_update(optimizer).run(rollouts)  # no trainer: plain autograd, no callbacks
    assert len(steps) == 6 and all(steps)
    module.algorithm = replace(module.algorithm, mini_batches=9)
    steps.clear()
    with caplog.at_level(logging.WARNING, logger="lit_rlvr.update.update"):
        module.make_update(optimizer).run(rollouts)
    assert len(steps) == 8 and "fewer than algorithm.mini_batches=9" in caplog.text

