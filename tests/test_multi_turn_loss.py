"""Observation tokens in the update (lit_rlvr.update.Update): visible to attention, absent from every loss term,
normaliser, ratio, KL and entropy; the micro-batching and the token-budget trimming keep them in the sequence."""

from __future__ import annotations

import pytest
import torch

from lit_rlvr.models.tiny import build_tiny, save
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.update import forward_logprobs

P, T = 3, 12
# per row: (model tokens, observation tokens, model tokens), right-padded to T
LAYOUT = [(2, 3, 2), (3, 1, 4), (1, 4, 1), (4, 2, 3)]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return str(save(*build_tiny(0), tmp_path_factory.mktemp("policy")))


def module_for(path, **kwargs) -> GRPOModule:
    options = {"group_size": 2, "max_new_tokens": T, "temperature": 0.7, "entropy_coef": 0.01, "kl_coef": 0.05,
               "loss_aggregation": "token-mean", **kwargs}
    return GRPOModule(model=path, **options)


def batch(layout=LAYOUT, obs_token=7, seed=0) -> Rollouts:
    """Rows of model tokens, an observation, model tokens; observation ids `obs_token` (+ the row index)."""
    g = torch.Generator().manual_seed(seed)
    n = len(layout)
    ids = torch.randint(10, 60, (n, T), generator=g)  # [N, T]
    mask = torch.zeros(n, T, dtype=torch.bool)
    present = torch.zeros(n, T, dtype=torch.bool)
    for i, (a, o, b) in enumerate(layout):
        present[i, : a + o + b] = True
        mask[i, :a] = True
        mask[i, a + o : a + o + b] = True
        ids[i, a : a + o] = obs_token + i
    ids[~present] = 0
    old = (-torch.rand(n, T, generator=g) - 0.5) * mask  # [N, T]
    prompt = torch.randint(10, 60, (n, P), generator=g)  # [N, P]
    return Rollouts(prompt_ids=prompt, prompt_mask=torch.ones(n, P, dtype=torch.bool),
                    response_ids=ids, response_mask=mask, old_logp=old, response_attention_mask=present,
                    group=torch.arange(n) // 2, source=torch.zeros(n, dtype=torch.long), num_groups=n // 2,
                    prompts=["p"] * (n // 2), answers=[0] * (n // 2), rewards=torch.tensor([1.0, -1.0, -1.0, 1.0]),
                    malformed=torch.zeros(n, dtype=torch.bool), advantages=torch.tensor([1.0, -1.0, -0.5, 0.5]))


def test_gradient_wrt_the_logits_of_observation_tokens_is_zero(policy_dir):
    update = module_for(policy_dir).make_update()  # no trainer: plain autograd
    rollouts = batch()
    captured = []
    forward = update.forward_logprobs

    def keep_logits(model, r):
        logp, logits = forward(model, r)
        if logits.requires_grad:
            logits.retain_grad()
            captured.append(logits)
        return logp, logits

    update.forward_logprobs = keep_logits
    loss, _ = update.micro_batch_loss(rollouts, 1.0)
    loss.backward()
    grad = captured[0].grad  # [N, T, V]: row t scores response token t
    observed = rollouts.response_attention_mask & ~rollouts.response_mask
    assert grad[observed].abs().max() == 0
    assert (grad[rollouts.response_mask].abs().sum(-1) > 0).all()  # model tokens do get a gradient


def test_observations_change_the_loss_only_through_later_model_tokens(policy_dir):
    """Two batches that differ only in their observations (text and length): with the model tokens' log-probs and
    logits held at batch A's values, batch B's loss and every metric equal A's, whatever B's observation positions
    hold. A normaliser that counted observation tokens, or a term that read them, would differ."""
    module = module_for(policy_dir)
    update = module.make_update()
    a = batch()
    longer = [(x, o + 2, y) for x, o, y in LAYOUT]
    b = batch(longer, obs_token=40)
    b.response_ids[b.response_mask] = a.response_ids[a.response_mask]  # the same model tokens, shifted
    b.old_logp[b.response_mask] = a.old_logp[a.response_mask]
    forward = update.forward_logprobs
    held = {}

    def hold(model, r):
        logp, logits = forward(model, r)
        key = "policy" if model is module.policy else "ref"
        if r is a:
            held[key] = (logp[a.response_mask], logits[a.response_mask])
            return logp, logits
        # elsewhere (observations, padding) other finite values, as a forward gives: nothing may read them
        logp = torch.full_like(logp, -3.3).masked_scatter(b.response_mask, held[key][0])
        logits = torch.randn_like(logits) * 5
        logits[b.response_mask] = held[key][1]
        return logp, logits

    update.forward_logprobs = hold
    loss_a, metrics_a = update.micro_batch_loss(a, 1.0)
    loss_b, metrics_b = update.micro_batch_loss(b, 1.0)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
    for k in metrics_a:
        torch.testing.assert_close(metrics_b[k], metrics_a[k], rtol=0, atol=1e-6, msg=k)


def test_attention_sees_observations(policy_dir):
    """The log-prob of a model token after an observation depends on the observation's tokens."""
    module = module_for(policy_dir)
    a, b = batch(obs_token=7), batch(obs_token=30)
    logp_a, _ = forward_logprobs(module.policy, a, temperature=module.algorithm.temperature)
    logp_b, _ = forward_logprobs(module.policy, b, temperature=module.algorithm.temperature)
    first = torch.tensor([x for x, _, _ in LAYOUT])
    rows = torch.arange(len(LAYOUT))
    torch.testing.assert_close(logp_a[rows, first - 1], logp_b[rows, first - 1])  # before: equal
    after = torch.tensor([x + o for x, o, _ in LAYOUT])
    assert (logp_a[rows, after] - logp_b[rows, after]).abs().min() > 1e-6  # after: the observation is read


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_loss_normalisers_count_model_tokens_only(policy_dir, aggregation):
    """The gradient of a batch does not depend on its micro-batching: per-row micro-batches weight each row by
    its model tokens (token-mean) or its sequence; counting observation tokens would break the equality."""
    grads = []
    for rows in (1, 64):
        module = module_for(policy_dir, micro_batch_size=rows, loss_aggregation=aggregation, kl_coef=0.0)
        torch.manual_seed(0)
        module.make_update().backward_pass(batch(), 0, {})  # no trainer: plain autograd
        grads.append(torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_token_budget_micro_batches_keep_observation_columns(policy_dir):
    r = batch()
    r.response_mask[:, 6:] = False  # no model token past column 6
    r.response_attention_mask[0, :] = True  # but row 0's sequence (observations) runs to the end
    trimmed = r.trim_padding()
    assert trimmed.response_ids.shape[1] == T  # the columns attention uses are kept
    module = module_for(policy_dir, micro_batch_tokens=64)
    sums: dict = {}
    module.make_update().backward_pass(batch(), 0, sums)
    assert sums["micro/count"] >= 1


def test_dapo_overlong_penalty_uses_the_rollouts_token_budget(policy_dir):
    """With an environment a rollout's budget is env.max_tokens over its whole response: several turns whose model
    tokens add up past one turn's max_new_tokens are not overlong."""
    options = {"group_size": 2, "max_new_tokens": 4, "overlong_cache_len": 2}
    single = GRPOModule(model=policy_dir, **options)
    multi = GRPOModule(model=policy_dir, **options, env="retry",
                       env_options={"options": {"reward": "arithmetic"}, "max_tokens": 12})
    r = batch()  # present tokens per row 7, 8, 6, 9 (model tokens 4, 7, 2, 7)
    _, with_env = multi.compute_advantages(r)
    _, without = single.compute_advantages(r)
    assert with_env["reward/shaped_mean"] == r.rewards.mean()  # 9 <= 12 - 2: no penalty
    assert without["reward/shaped_mean"] < r.rewards.mean()  # model tokens past 4 - 2 are penalised
