"""What one `Update.run` does, checked against oracles computed outside it: the KL term pulls the policy towards the
reference and the entropy bonus away from determinism (the signs); the reported loss is the loss of the whole batch
whatever the micro-batching; the number of optimizer and scheduler steps; the gradient clip; the skip of a step
that is only partly finite (an M3PO pass whose gradient is NaN while the loss is finite); the stop when every loss
token is masked; decoupled mode's recomputed π_old; and a callback's token weights times bypass mode's rejection."""

from __future__ import annotations

import logging

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.config.errors import MaskedStepError, NonFiniteError
from lit_rlvr.config.rollout_correction import RolloutCorrection
from lit_rlvr.config.settings import LossConfig, UpdateConfig
from lit_rlvr.models.tiny import build_tiny
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.run import distributed as D
from lit_rlvr.update import Update
from lit_rlvr.update.correction import RolloutCorrector
from lit_rlvr.update.forward import forward_logprobs

T, TEMPERATURE = 6, 0.7
LENGTHS = [1, 6, 3, 4, 2, 5, 6, 3]


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    policy = build_tiny(seed)[0]
    return policy.train()


def batch(n: int = 8, seed: int = 0) -> Rollouts:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T) < torch.tensor((LENGTHS * 2)[:n])[:, None]  # [n, T]
    return Rollouts(
        prompt_ids=torch.randint(4, 90, (n, 5), generator=g), prompt_mask=torch.ones(n, 5, dtype=torch.bool),
        response_ids=torch.randint(4, 90, (n, T), generator=g), response_mask=mask,
        old_logp=(-4.0 - torch.rand(n, T, generator=g)) * mask, group=torch.arange(n) // 4,
        source=torch.zeros(n, dtype=torch.long), num_groups=(n + 3) // 4, prompts=["a"] * ((n + 3) // 4),
        answers=[0] * ((n + 3) // 4), advantages=torch.randn(n, generator=g))


def ppo(logp, old, adv, mask, rollouts):
    return F.ppo_clip_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, aggregation="token-mean", norm_len=T,
                           token_weights=rollouts.token_weights)


def no_policy_gradient(logp, old, adv, mask, rollouts):
    """A surrogate that is 0 with gradient 0: only the KL and entropy terms move the policy."""
    return (logp * 0.0).sum(), {}


def make(policy, *, loss=None, update=None, optimizer=None, lr=0.1, **kw) -> Update:
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(policy.parameters(), lr=lr)
    return Update(policy, optimizer, loss=loss or LossConfig(loss_aggregation="token-mean"),
                  update=update or UpdateConfig(), grad_clip=kw.pop("grad_clip", None), temperature=TEMPERATURE,
                  norm_len=T, policy_loss=kw.pop("policy_loss", ppo), **kw)


def logprobs(model, rollouts) -> torch.Tensor:
    with torch.no_grad():
        return forward_logprobs(model, rollouts, temperature=TEMPERATURE, device="cpu")[0] * rollouts.response_mask


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def moved(before, model) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- the signs of the KL and entropy terms ----------------------------------------------------------------------------
def test_the_kl_term_is_added_and_pulls_the_policy_towards_the_reference():
    policy, reference = tiny_policy(0), tiny_policy(1).requires_grad_(False).eval()
    rollouts = batch()
    loss = LossConfig(kl_coef=0.5, kl_estimator="k1", loss_aggregation="token-mean")
    update = make(policy, loss=loss, ref_policy=reference, policy_loss=no_policy_gradient, lr=0.5)
    # the oracle: token-mean of k1 = log π - log π_ref over the response tokens, at the weights before the step
    k1 = logprobs(policy, rollouts) - logprobs(reference, rollouts)
    expected = (k1 * rollouts.response_mask).sum() / rollouts.response_mask.sum()
    first = update.run(rollouts)
    torch.testing.assert_close(first["loss/kl_ref"], expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first["loss/policy"], 0.5 * expected, rtol=1e-4, atol=1e-5)  # + kl_coef × KL
    kls = [float(first["loss/kl_ref"])] + [float(update.run(rollouts)["loss/kl_ref"]) for _ in range(4)]
    assert kls[-1] < kls[0] - 0.05, kls  # descending the loss lowers the KL to the reference


def test_no_kl_term_without_kl_coef():
    policy = tiny_policy(0)
    metrics = make(policy, ref_policy=tiny_policy(1), policy_loss=no_policy_gradient).run(batch())
    assert "loss/kl_ref" not in metrics
    assert float(metrics["loss/policy"]) == 0.0


def test_the_entropy_bonus_is_subtracted_and_raises_the_entropy():
    policy = tiny_policy(0)
    rollouts = batch()
    update = make(policy, loss=LossConfig(entropy_coef=0.5, loss_aggregation="token-mean"),
                  policy_loss=no_policy_gradient, lr=2.0)
    first = update.run(rollouts)
    torch.testing.assert_close(first["loss/policy"], -0.5 * first["loss/entropy"], rtol=1e-4, atol=1e-6)
    entropies = [float(first["loss/entropy"])] + [float(update.run(rollouts)["loss/entropy"]) for _ in range(4)]
    assert entropies[-1] > entropies[0], entropies


def test_the_entropy_metric_is_per_token_whatever_the_aggregation():
    rollouts = batch()
    token = make(tiny_policy(0), loss=LossConfig(loss_aggregation="token-mean"), lr=0.0).run(rollouts)
    seq = make(tiny_policy(0), loss=LossConfig(loss_aggregation="seq-mean-token-mean"), lr=0.0).run(rollouts)
    torch.testing.assert_close(token["loss/entropy"], seq["loss/entropy"], rtol=1e-5, atol=1e-6)


# -- the loss of the whole batch, the steps taken ---------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("micro, tokens, n", [(1, None, 8), (3, None, 8), (8, None, 8), (8, 30, 8), (8, None, 1)])
def test_the_reported_loss_is_the_whole_batchs_whatever_the_micro_batching(aggregation, micro, tokens, n):
    """Also with a token budget (trimmed micro-batches) and for a batch of one token (n=1)."""
    policy, rollouts = tiny_policy(0), batch(n)

    def loss_fn(logp, old, adv, mask, r):
        return F.ppo_clip_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, aggregation=aggregation,
                               norm_len=T, token_weights=r.token_weights)

    # the oracle: the loss of the full batch at the weights before the step (one optimizer step: mini_batches=1)
    with torch.no_grad():
        logp = forward_logprobs(policy, rollouts, temperature=TEMPERATURE, device="cpu")[0]
        expected, _ = loss_fn(logp, rollouts.old_logp, rollouts.advantages, rollouts.response_mask, rollouts)
    update = make(policy, loss=LossConfig(loss_aggregation=aggregation),
                  update=UpdateConfig(micro_batch_size=micro, micro_batch_tokens=tokens), policy_loss=loss_fn, lr=0.0)
    metrics = update.run(rollouts)
    torch.testing.assert_close(metrics["loss/policy"], expected, rtol=1e-4, atol=1e-6)


def test_micro_batch_metrics_of_the_fixed_split():
    """Fixed micro-batches run at the batch's full width (prompt 5 + response 6): padding = 1 - 70 / (8 × 11)."""
    metrics = make(tiny_policy(0), update=UpdateConfig(micro_batch_size=3, ppo_epochs=2), lr=0.0).run(batch())
    assert float(metrics["micro/count"]) == 3.0  # ceil(8 / 3), the mean over two passes
    torch.testing.assert_close(metrics["micro/padding_frac"], torch.tensor(1 - 70 / 88), rtol=1e-5, atol=1e-6)


def test_metrics_are_means_over_the_loss_passes():
    """Two epochs at lr 0 see the same batch twice: every pass metric is the one pass's value."""
    rollouts = batch()
    once = make(tiny_policy(0), lr=0.0).run(rollouts)
    twice = make(tiny_policy(0), lr=0.0, update=UpdateConfig(ppo_epochs=2)).run(rollouts)
    for key in ("loss/policy", "loss/entropy", "loss/pg_clipfrac"):
        torch.testing.assert_close(twice[key], once[key], rtol=1e-4, atol=1e-6, msg=key)


def test_the_gradient_is_the_whole_batchs_whatever_the_micro_batching():
    """One plain SGD step: the weights moved by lr × the gradient of the full batch's loss."""
    rollouts = batch()
    reference = tiny_policy(0)
    logp = forward_logprobs(reference, rollouts, temperature=TEMPERATURE, device="cpu")[0]
    loss, _ = ppo(logp, rollouts.old_logp, rollouts.advantages, rollouts.response_mask, rollouts)
    loss.backward()
    expected = [p.detach() - 0.1 * p.grad for p in reference.parameters()]
    for micro in (2, 8):
        policy = tiny_policy(0)
        make(policy, update=UpdateConfig(micro_batch_size=micro), lr=0.1).run(rollouts)
        for got, want in zip(policy.parameters(), expected):
            torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-6)


class CountingSGD(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


class CountingScheduler:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


@pytest.mark.parametrize("n, epochs, minis, expected", [(8, 2, 2, 4), (8, 1, 3, 3), (3, 1, 5, 3), (2, 2, 1, 2)])
def test_optimizer_and_scheduler_steps(n, epochs, minis, expected):
    """ppo_epochs × mini_batches steps, and no more steps than rollouts (each on at least one)."""
    policy = tiny_policy(0)
    optimizer, scheduler = CountingSGD(policy.parameters(), lr=0.01), CountingScheduler()
    seen = []

    def loss_fn(logp, old, adv, mask, r):
        seen.append(r.num_samples)
        return ppo(logp, old, adv, mask, r)

    update = make(policy, optimizer=optimizer, scheduler=scheduler, policy_loss=loss_fn,
                  update=UpdateConfig(ppo_epochs=epochs, mini_batches=minis))
    metrics = update.run(batch(n))
    assert optimizer.steps == scheduler.steps == expected
    assert sum(seen) == n * epochs and min(seen) >= 1  # every rollout once per epoch, no empty mini-batch
    assert metrics["grad/norm"].ndim == 0 and float(metrics["grad/norm"]) > 0


@pytest.mark.parametrize("n, minis, warned", [(3, 5, True), (4, 4, False), (8, 2, False)])
def test_fewer_rollouts_than_mini_batches_is_said(caplog, n, minis, warned):
    with caplog.at_level(logging.WARNING, logger="lit_rlvr.update.update"):
        make(tiny_policy(0), update=UpdateConfig(mini_batches=minis), lr=0.0).run(batch(n), step=4)
    expected = f"step 4: a rank holds {n} rollouts, fewer than algorithm.mini_batches={minis}: {n} optimizer steps"
    assert (expected in caplog.text) == warned


def test_grad_norm_is_the_mean_over_steps_of_the_norm_before_clipping():
    rollouts = batch()
    clipped, free = tiny_policy(0), tiny_policy(0)
    a = make(clipped, grad_clip=1e-4, lr=1.0).run(rollouts)
    before = weights(free)
    b = make(free, grad_clip=0.0, lr=1.0).run(rollouts)  # 0: no clip
    torch.testing.assert_close(a["grad/norm"], b["grad/norm"])  # the norm before clipping
    assert float(a["grad/norm"]) > 1e-3
    step = torch.cat([(p.detach() - w).flatten() for p, w in zip(free.parameters(), before)]).norm()
    torch.testing.assert_close(step, b["grad/norm"], rtol=1e-3, atol=1e-6)  # unclipped: lr × gradient
    moved_clipped = torch.cat([(p.detach() - w).flatten() for p, w in zip(clipped.parameters(), before)]).norm()
    torch.testing.assert_close(moved_clipped, torch.tensor(1e-4), rtol=1e-2, atol=1e-7)  # clipped to the bound


def test_a_negative_grad_clip_is_off():
    rollouts = batch()
    policy = tiny_policy(0)
    before = weights(policy)
    metrics = make(policy, grad_clip=-1.0, lr=1.0).run(rollouts)
    step = torch.cat([(p.detach() - w).flatten() for p, w in zip(policy.parameters(), before)]).norm()
    torch.testing.assert_close(step, metrics["grad/norm"], rtol=1e-3, atol=1e-6)


# -- non-finite steps ------------------------------------------------------------------------------------------------
def clearing_context(policy):
    """A loss context that clears the gradients on entry, as 3PO's weight sample does between loss passes."""

    def context(rollouts, loss_pass):
        for p in policy.parameters():
            p.grad = None
        return torch.enable_grad()

    return context


def two_pass_batch() -> Rollouts:
    rollouts = batch()
    rollouts.loss_pass = torch.arange(8) % 2  # two loss passes (M3PO's weight samples)
    return rollouts


def nan_gradient_in_pass(bad_pass: int):
    """A finite loss whose gradient is NaN (sqrt at 0) in loss pass `bad_pass` only: pass 0 has the even rows."""

    def loss_fn(logp, old, adv, mask, r):
        loss, metrics = ppo(logp, old, adv, mask, r)
        if int(r.loss_pass[0]) == bad_pass:
            loss = loss + ((logp * 0.0).sum() ** 2).sqrt()  # value 0, gradient 0 × inf = NaN
        return loss, metrics

    return loss_fn


@pytest.mark.parametrize("bad_pass", [0, 1])
def test_a_step_whose_earlier_pass_had_a_non_finite_gradient_is_skipped(bad_pass):
    policy = tiny_policy(0)
    before = weights(policy)
    update = make(policy, policy_loss=nan_gradient_in_pass(bad_pass), loss_contexts=[clearing_context(policy)],
                  update=UpdateConfig(max_bad_steps=3))
    metrics = update.run(two_pass_batch())
    assert torch.isfinite(metrics["loss/policy"])  # the loss was finite: only a gradient was not
    assert not moved(before, policy)
    assert update.counters == {"skipped_steps": 1, "bad_steps_in_row": 1}
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0 for p in policy.parameters())  # cleared


def test_a_step_whose_passes_are_all_finite_is_taken():
    policy = tiny_policy(0)
    before = weights(policy)
    update = make(policy, loss_contexts=[clearing_context(policy)])
    update.counters["bad_steps_in_row"] = 2  # an earlier bad step: reset by a good one
    update.run(two_pass_batch())
    assert moved(before, policy)
    assert update.counters == {"skipped_steps": 0, "bad_steps_in_row": 0}


def test_a_non_finite_loss_is_named_and_stops_the_run_at_max_bad_steps(caplog):
    policy = tiny_policy(0)
    rollouts = batch()
    rollouts.advantages = torch.full_like(rollouts.advantages, float("nan"))
    discarded = []
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    optimizer.discard_samples = lambda: discarded.append(1)  # IVON's: a skipped step's samples are dropped
    update = make(policy, optimizer=optimizer, update=UpdateConfig(max_bad_steps=2))
    with caplog.at_level(logging.WARNING, logger="lit_rlvr.update.update"):
        update.run(rollouts, step=7)
    assert "non-finite loss at step 7" in caplog.text
    assert update.counters == {"skipped_steps": 1, "bad_steps_in_row": 1} and discarded == [1]
    with caplog.at_level(logging.WARNING, logger="lit_rlvr.update.update"):
        with pytest.raises(NonFiniteError, match="2 non-finite steps in a row"):
            update.run(rollouts)  # no step given: 0
    assert "non-finite loss at step 0" in caplog.text


def test_a_non_finite_gradient_with_a_finite_loss_is_named(caplog):
    policy = tiny_policy(0)
    update = make(policy, policy_loss=nan_gradient_in_pass(0))
    rollouts = batch()
    rollouts.loss_pass = torch.zeros(8, dtype=torch.long)
    with caplog.at_level(logging.WARNING, logger="lit_rlvr.update.update"):
        update.run(rollouts, step=3)
    assert "non-finite gradient at step 3" in caplog.text


# -- masked steps --------------------------------------------------------------------------------------------------
def test_every_token_masked_by_the_sequence_mask_stops_the_run():
    policy = tiny_policy(0)
    rollouts = batch()
    rollouts.old_logp = (logprobs(policy, rollouts) - 3.0) * rollouts.response_mask  # ratios e^3, far past τ
    update = make(policy, loss=LossConfig(seq_mask_tau=1.5, loss_aggregation="token-mean"))
    with pytest.raises(MaskedStepError, match=r"every one of the 30 loss tokens was masked.*seq_mask_tau=1\.5"):
        update.run(rollouts, step=2)


def test_a_sequence_mask_that_keeps_some_tokens_trains():
    policy = tiny_policy(0)
    rollouts = batch()
    old = logprobs(policy, rollouts)
    old[:4] -= 3.0  # half the rows far past τ, half at ratio 1
    rollouts.old_logp = old * rollouts.response_mask
    before = weights(policy)
    metrics = make(policy, loss=LossConfig(seq_mask_tau=1.5, loss_aggregation="token-mean")).run(rollouts)
    assert moved(before, policy)
    torch.testing.assert_close(metrics["loss/seq_mask_frac"], torch.tensor(0.5))


def test_an_update_without_loss_tokens_is_not_a_masked_step():
    policy = tiny_policy(0)
    rollouts = batch()
    rollouts.response_mask = torch.zeros_like(rollouts.response_mask)
    rollouts.old_logp = torch.zeros_like(rollouts.old_logp)
    make(policy, loss=LossConfig(seq_mask_tau=1.5, loss_aggregation="token-mean")).run(rollouts)  # no error


def test_token_weights_of_zero_everywhere_stop_the_run():
    policy = tiny_policy(0)
    rollouts = batch()
    rollouts.token_weights = torch.zeros(8, T)
    with pytest.raises(MaskedStepError, match="no masking setting is on"):
        make(policy).run(rollouts)
    rollouts.token_weights[0, 0] = 1.0  # one token kept: trains
    make(tiny_policy(0)).run(rollouts)


# -- rollout correction ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("micro", [3, 8])
def test_decoupled_mode_recomputes_pi_old_at_the_current_weights(micro):
    policy, rollouts = tiny_policy(0), batch()
    correction = RolloutCorrector(RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0))
    update = make(policy, correction=correction, update=UpdateConfig(micro_batch_size=micro))
    corrected, metrics = update.correct(rollouts)
    torch.testing.assert_close(corrected.old_logp, logprobs(policy, rollouts), rtol=1e-5, atol=1e-6)
    assert corrected.token_weights is not None and any(k.startswith("mismatch/") for k in metrics)
    assert "old_logp_s" in update.timer.times


def test_bypass_rejection_multiplies_a_callbacks_token_weights():
    """In bypass mode the rejection mask of the current log-probs multiplies the batch's token weights: a rejected
    row's weights become 0, a kept row's stay as the callback set them."""
    rollouts = batch(4)
    logp = torch.zeros(4, T)
    engine = torch.zeros(4, T)
    engine[1] -= 5.0  # row 1: sequence ratio e^5 (per token), far outside [1/2, 2]
    mask = rollouts.response_mask
    rollouts.token_weights = torch.full((4, T), 3.0)
    corrector = RolloutCorrector(RolloutCorrection(rollout_rs="token", rollout_rs_threshold=2.0, bypass_mode=True))
    corrector.before_update(rollouts)
    out = corrector.in_loss(rollouts, logp, engine, mask)
    expected = torch.full((4, T), 3.0)
    expected[1] = torch.where(mask[1], 0.0, 3.0)  # only the response tokens are rejected
    assert out.token_weights is not None
    torch.testing.assert_close(out.token_weights * mask, expected * mask)
    metrics = corrector.first_pass_metrics()
    assert metrics and corrector.first_pass_metrics() == {}  # once per update


def test_bypass_without_rejection_keeps_the_batch_as_it_is():
    rollouts = batch(4)
    corrector = RolloutCorrector(RolloutCorrection(bypass_mode=True))
    corrector.before_update(rollouts)
    assert corrector.in_loss(rollouts, torch.zeros(4, T), rollouts.old_logp, rollouts.response_mask) is rollouts


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_two_identical_ranks_report_the_loss_of_one(monkeypatch, aggregation):
    """Data-parallel weighting: with a second rank holding the same batch (sums over ranks doubled), each rank's
    loss and metrics are the single process's (its micro-batch weights × world size, then averaged by the ranks'
    gradient mean)."""
    rollouts = batch()
    single = make(tiny_policy(0), loss=LossConfig(loss_aggregation=aggregation), lr=0.0,
                  update=UpdateConfig(micro_batch_size=3)).run(rollouts)
    monkeypatch.setattr(D, "world_size", lambda: 2)
    monkeypatch.setattr(D, "all_reduce", lambda value, op="sum", group=None: value * 2 if op == "sum" else value)
    double = make(tiny_policy(0), loss=LossConfig(loss_aggregation=aggregation), lr=0.0,
                  update=UpdateConfig(micro_batch_size=3)).run(rollouts)
    for key in ("loss/policy", "loss/entropy", "loss/pg_clipfrac"):
        torch.testing.assert_close(double[key], single[key], rtol=1e-4, atol=1e-6, msg=key)


def test_bypass_rejection_bounds_the_engine_over_trainer_ratio():
    """An asymmetric band [0.2, 2] on π_engine/π_trainer (verl >= 0.7): a ratio of 1/3 is kept, 3 rejected."""
    rollouts = batch(4)
    mask = rollouts.response_mask
    engine = torch.full((4, T), -1.0)
    logp = engine.clone()
    logp[1] += torch.log(torch.tensor(3.0))  # row 1: π_engine/π_trainer = 1/3 (kept)
    logp[2] -= torch.log(torch.tensor(3.0))  # row 2: π_engine/π_trainer = 3 (rejected)
    corrector = RolloutCorrector(RolloutCorrection(rollout_rs="token", rollout_rs_threshold="0.2_2",
                                                   bypass_mode=True))
    corrector.before_update(rollouts)
    out = corrector.in_loss(rollouts, logp, engine, mask)
    kept = (out.token_weights * mask).sum(-1) / mask.sum(-1)
    assert kept.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_bypass_metrics_of_micro_batches_of_different_widths_are_the_whole_batchs():
    """The first pass's recorded forwards ([2, 3] and [2, 6] micro-batches) give the metrics of the batch as one."""
    from lit_rlvr.functional import rollout_correction as RC

    g = torch.Generator().manual_seed(1)
    mask = torch.arange(T) < torch.tensor([2, 3, 6, 4])[:, None]
    logp = -torch.rand(4, T, generator=g) * mask
    engine = (logp + 0.3 * torch.randn(4, T, generator=g)) * mask
    options = RolloutCorrection(rollout_rs="token", rollout_rs_threshold="0.8_1.25", bypass_mode=True)
    corrector = RolloutCorrector(options)
    rollouts = batch(4)
    corrector.before_update(rollouts)
    corrector.in_loss(rollouts.select(torch.tensor([0, 1])), logp[:2, :3], engine[:2, :3], mask[:2, :3])
    corrector.in_loss(rollouts.select(torch.tensor([2, 3])), logp[2:], engine[2:], mask[2:])
    corrector.in_loss(rollouts, logp * 0, engine, mask, record=False)  # a stand-in: not recorded
    got = corrector.first_pass_metrics()
    _, expected = RC.mismatch_metrics(logp, engine, mask)
    _, rejected = RC.rejection_mask(logp - engine, mask, modes="token", threshold="0.8_1.25")
    expected.update(rejected)
    assert got.keys() == expected.keys() and any(k.startswith("mismatch/") for k in got)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def manual_logprobs(model, ids, response_ids):
    """The oracle: the model's own default positions on an unpadded sequence."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -response_ids.shape[1] - 1:-1]
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, response_ids[..., None])[..., 0]


def test_forward_logprobs_ignore_left_padding():
    policy = tiny_policy(0).eval()
    g = torch.Generator().manual_seed(3)
    prompt, response = torch.randint(4, 90, (1, 4), generator=g), torch.randint(4, 90, (1, 3), generator=g)
    expected = manual_logprobs(policy, torch.cat([prompt, response], 1), response)
    padded = Rollouts(
        prompt_ids=torch.cat([torch.zeros(1, 2, dtype=torch.long), prompt], 1),
        prompt_mask=torch.tensor([[False, False, True, True, True, True]]), response_ids=response,
        response_mask=torch.ones(1, 3, dtype=torch.bool), old_logp=torch.zeros(1, 3), group=torch.zeros(1).long(),
        source=torch.zeros(1).long(), num_groups=1, prompts=["a"], answers=[0])
    torch.testing.assert_close(logprobs(policy, padded), expected, rtol=1e-4, atol=1e-5)


class StandIns:
    """Another rank with one micro-batch more: this rank runs a zero-weight stand-in."""

    @staticmethod
    def global_max(value, group=None):
        return value if value < 0 else value + 1


def test_a_zero_weight_stand_in_micro_batch_changes_nothing(monkeypatch):
    rollouts = batch()
    plain_policy = tiny_policy(0)
    plain = make(plain_policy, update=UpdateConfig(micro_batch_size=3)).run(rollouts)
    monkeypatch.setattr(D, "global_max", StandIns.global_max)
    padded_policy = tiny_policy(0)
    padded = make(padded_policy, update=UpdateConfig(micro_batch_size=3)).run(rollouts)
    for key in ("loss/policy", "loss/entropy", "grad/norm"):
        torch.testing.assert_close(padded[key], plain[key], rtol=1e-5, atol=1e-7, msg=key)
    for a, b in zip(plain_policy.parameters(), padded_policy.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_sequence_level_losss_clip_fraction_is_weighted_by_sequences():
    """GSPO's clip fraction is a mean over sequences: micro-batched with token-mean weights it stays the whole
    batch's fraction of sequences."""
    rollouts = batch()

    def loss_fn(logp, old, adv, mask, r):
        loss, _ = ppo(logp, old, adv, mask, r)
        return loss, {"loss/pg_clipfrac": (adv > 0).float().mean()}  # a per-sequence fraction

    metrics = make(tiny_policy(0), loss=LossConfig(policy_loss="gspo", loss_aggregation="token-mean"),
                   update=UpdateConfig(micro_batch_size=3), policy_loss=loss_fn, lr=0.0).run(rollouts)
    torch.testing.assert_close(metrics["loss/pg_clipfrac"], (rollouts.advantages > 0).float().mean())


@pytest.mark.parametrize("is_level, rs", [("token", "token"), ("token", None), (None, "token"), ("sequence", "token")])
def test_decoupled_is_weights_times_the_rejection_mask(is_level, rs):
    """Decoupled mode: the loss's token weights are the truncated IS weights π_old/π_engine times the rejection
    mask, both from the recomputed π_old (an IcePop band [0.5, 2] for IS, [0.4, 1.5] for rejection)."""
    from lit_rlvr.functional import rollout_correction as RC

    policy, rollouts = tiny_policy(0), batch()
    old = logprobs(policy, rollouts)
    g = torch.Generator().manual_seed(4)
    rollouts.old_logp = (old + 0.6 * torch.randn(8, T, generator=g)) * rollouts.response_mask  # the engine's
    options = RolloutCorrection(rollout_is=is_level, rollout_is_threshold="0.5_2", rollout_rs=rs,
                                rollout_rs_threshold="0.4_1.5")
    corrected, metrics = make(policy, correction=RolloutCorrector(options)).correct(rollouts)
    ratio = old - rollouts.old_logp
    expected = torch.ones(8, T)
    if is_level is not None:
        expected = RC.truncated_is_weights(ratio, rollouts.response_mask, level=is_level, threshold="0.5_2")[0]
    if rs is not None:
        keep = RC.rejection_mask(ratio, rollouts.response_mask, modes=rs, threshold="0.4_1.5")[0]
        assert 0 < int(keep.sum()) < int(rollouts.response_mask.sum())  # some rejected, some kept
        expected = expected * keep
    mask = rollouts.response_mask
    torch.testing.assert_close(corrected.token_weights * mask, expected * mask, rtol=1e-4, atol=1e-6)
    assert ("mismatch/rs_masked_frac" in metrics) == (rs is not None)


def test_a_stand_in_micro_batch_changes_nothing_under_a_sequence_mean(monkeypatch):
    loss = LossConfig(loss_aggregation="seq-mean-token-mean")
    plain_policy, padded_policy = tiny_policy(0), tiny_policy(0)
    plain = make(plain_policy, loss=loss, update=UpdateConfig(micro_batch_size=3)).run(batch())
    monkeypatch.setattr(D, "global_max", StandIns.global_max)
    padded = make(padded_policy, loss=loss, update=UpdateConfig(micro_batch_size=3)).run(batch())
    torch.testing.assert_close(padded["loss/policy"], plain["loss/policy"], rtol=1e-5, atol=1e-7)
    for a, b in zip(plain_policy.parameters(), padded_policy.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bypass_metrics_of_an_update_are_its_first_passs_over_the_real_micro_batches(monkeypatch):
    """Bypass mode: `mismatch/*` come from the first mini-batch's forwards, at the weights that sampled, over the
    real micro-batches only (a stand-in is not recorded)."""
    from lit_rlvr.functional import rollout_correction as RC

    monkeypatch.setattr(D, "global_max", StandIns.global_max)
    policy, rollouts = tiny_policy(0), batch()
    current = logprobs(policy, rollouts)
    g = torch.Generator().manual_seed(5)
    rollouts.old_logp = (current + 0.5 * torch.randn(8, T, generator=g)) * rollouts.response_mask
    options = RolloutCorrection(rollout_rs="token", rollout_rs_threshold="0.1_10", bypass_mode=True)
    metrics = make(policy, correction=RolloutCorrector(options), update=UpdateConfig(micro_batch_size=3)).run(rollouts)
    _, expected = RC.mismatch_metrics(current, rollouts.old_logp, rollouts.response_mask)
    expected.update(RC.rejection_mask(current - rollouts.old_logp, rollouts.response_mask, modes="token",
                                      threshold="0.1_10")[1])
    for key, value in expected.items():
        torch.testing.assert_close(metrics[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_loss_passes_without_an_optimizer():
    """Built with optimizer=None: `backward_pass` accumulates gradients and metric sums; `run` is refused."""
    policy, rollouts = tiny_policy(0), batch()
    update = Update(policy, None, loss=LossConfig(loss_aggregation="token-mean"), update=UpdateConfig(),
                    grad_clip=None, temperature=TEMPERATURE, norm_len=T, policy_loss=ppo)
    sums: dict = {}
    update.backward_pass(rollouts, 0, sums)
    assert "loss/policy" in sums and float(sums["micro/count"]) == 1.0
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in policy.parameters())
    with pytest.raises(ValueError, match="Update.run needs an optimizer"):
        update.run(rollouts)


def test_the_entropy_metric_is_at_the_sampling_temperature():
    policy, rollouts = tiny_policy(0), batch()
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], 1)
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[:, -T - 1:-1] / TEMPERATURE  # [n, T, V]
    per_token = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    mask = rollouts.response_mask
    expected = (per_token * mask).sum() / mask.sum()
    metrics = make(policy, lr=0.0).run(rollouts)
    torch.testing.assert_close(metrics["loss/entropy"], expected, rtol=1e-4, atol=1e-5)


def test_the_loss_contexts_see_each_pass_number():
    seen = []
    policy = tiny_policy(0)

    def context(rollouts, loss_pass):
        seen.append((loss_pass, rollouts.num_samples))
        return torch.enable_grad()

    make(policy, loss_contexts=[context]).run(batch())
    assert seen == [(0, 8)]  # one pass, numbered 0
    seen.clear()
    make(policy, loss_contexts=[context]).run(two_pass_batch())
    assert seen == [(0, 4), (1, 4)]


def test_no_gradient_at_all_is_a_norm_of_zero():
    policy = tiny_policy(0)
    update = make(policy, backward=lambda loss: None)  # a backward that makes no gradient
    assert float(update.grad_norm()) == 0.0
    before = weights(policy)
    metrics = update.run(batch())
    assert float(metrics["grad/norm"]) == 0.0 and not moved(before, policy)
    assert update.counters["skipped_steps"] == 0
