"""`lit_rlvr.update.Update` from a plain script: built from explicit parts (a policy, an optimizer, the typed
settings, a loss function), with no module and no trainer, one update on a hand-made batch moves the weights as the
module's update does, and the module's non-finite-step counts are the ones the update keeps."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from lit_rlvr import functional as F
from lit_rlvr.config.errors import NonFiniteError
from lit_rlvr.config.settings import LossConfig, UpdateConfig
from lit_rlvr.models import load_policy
from lit_rlvr.models.tiny import build_tiny, save
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.update import Update

# the settings both sides use: KL to a reference copy, entropy, two optimizer steps of micro-batches of 3
LOSS = LossConfig(kl_coef=0.05, entropy_coef=0.01, loss_aggregation="token-mean", eps_high=0.28)
UPDATE = UpdateConfig(mini_batches=2, micro_batch_size=3)
TEMPERATURE, MAX_NEW_TOKENS, LR = 0.7, 6, 1e-3


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return str(save(*build_tiny(0), tmp_path_factory.mktemp("policy")))


def batch() -> Rollouts:
    """8 completions of 2 prompts, responses of 1–6 tokens, behaviour log-probs near the policy's."""
    g = torch.Generator().manual_seed(0)
    n, p, t = 8, 5, MAX_NEW_TOKENS
    mask = torch.arange(t) < torch.tensor([1, 6, 3, 4, 2, 5, 6, 3])[:, None]  # [n, t]
    return Rollouts(
        prompt_ids=torch.randint(4, 90, (n, p), generator=g), prompt_mask=torch.ones(n, p, dtype=torch.bool),
        response_ids=torch.randint(4, 90, (n, t), generator=g), response_mask=mask,
        old_logp=(-4.0 - torch.rand(n, t, generator=g)) * mask, group=torch.arange(n) // 4,
        source=torch.zeros(n, dtype=torch.long), num_groups=2, prompts=["a", "b"], answers=[0, 0],
        advantages=torch.randn(n, generator=g))


def ppo_clip(logp, old_logp, advantages, mask, rollouts):
    """The loss function part: `functional.ppo_clip_loss` with the batch's token weights."""
    return F.ppo_clip_loss(logp, old_logp, advantages, mask, eps_low=LOSS.eps_low, eps_high=LOSS.eps_high,
                           aggregation=LOSS.loss_aggregation, norm_len=MAX_NEW_TOKENS,
                           token_weights=rollouts.token_weights)


def plain_update(path: str) -> tuple[dict, list[torch.Tensor]]:
    """One update as a script runs it: no module, no trainer, no Lightning loop."""
    policy, _ = load_policy(path)
    policy.train()
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR)
    update = Update(policy, optimizer, loss=LOSS, update=UPDATE, grad_clip=1.0, temperature=TEMPERATURE,
                    norm_len=MAX_NEW_TOKENS, policy_loss=ppo_clip, ref_policy=reference)
    metrics = update.run(batch())
    return metrics, [p.detach().clone() for p in policy.parameters()]


def module_update(path: str) -> tuple[dict, list[torch.Tensor]]:
    module = GRPOModule(model=path, group_size=4, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, lr=LR,
                        kl_coef=LOSS.kl_coef, entropy_coef=LOSS.entropy_coef, eps_high=LOSS.eps_high,
                        loss_aggregation=LOSS.loss_aggregation, mini_batches=UPDATE.mini_batches,
                        micro_batch_size=UPDATE.micro_batch_size)
    metrics = module.make_update(torch.optim.AdamW(module.policy.parameters(), lr=LR)).run(batch())
    return metrics, [p.detach().clone() for p in module.policy.parameters()]


def test_a_plain_script_update_equals_the_modules(policy_dir):
    before = [p.detach().clone() for p in load_policy(policy_dir)[0].parameters()]
    plain_metrics, plain_weights = plain_update(policy_dir)
    module_metrics, module_weights = module_update(policy_dir)
    assert plain_metrics.keys() == module_metrics.keys() >= {"loss/policy", "loss/kl_ref", "loss/entropy",
                                                             "grad/norm", "micro/count"}
    for key, value in module_metrics.items():
        # the same parts on the same shapes; the tolerance only allows another summation order
        torch.testing.assert_close(plain_metrics[key], value, rtol=1e-5, atol=1e-7, msg=key)
    assert any(not torch.equal(a, b) for a, b in zip(module_weights, before))  # the update moved the weights
    for plain, module in zip(plain_weights, module_weights, strict=True):
        torch.testing.assert_close(plain, module, rtol=1e-5, atol=1e-7)


def test_non_finite_steps_are_counted_in_the_counters_it_was_given(policy_dir):
    """The module hands its `counters` to the update: skipped steps land under the keys its checkpoints save."""
    module = GRPOModule(model=policy_dir, group_size=4, max_new_tokens=MAX_NEW_TOKENS, mini_batches=2,
                        max_bad_steps=5)
    rollouts = batch()
    rollouts.advantages = torch.full_like(rollouts.advantages, float("nan"))  # a NaN loss in both steps
    module.make_update(torch.optim.AdamW(module.policy.parameters(), lr=LR)).run(rollouts)
    assert (module.counters["skipped_steps"], module.counters["bad_steps_in_row"]) == (2, 2)
    module.algorithm = replace(module.algorithm, max_bad_steps=3)  # the next update reads the replaced settings
    with pytest.raises(NonFiniteError, match=r"3 non-finite steps in a row \(algorithm\.max_bad_steps=3\)"):
        module.make_update(torch.optim.AdamW(module.policy.parameters(), lr=LR)).run(rollouts)


class DeviceProbe(torch.nn.Module):
    """A stand-in policy: zero logits on the device its input ids are on, which it remembers, with the positions."""

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
        self.seen, self.positions = input_ids.device, position_ids
        return SimpleNamespace(logits=torch.zeros(len(input_ids), logits_to_keep, 100, device=input_ids.device))


def test_forwards_run_on_the_device_given_else_where_the_batch_or_the_policy_is(policy_dir):
    """A second device on a CPU-only machine: `meta` (shapes only). The forward moves the batch to the device it is
    given, else leaves it where it is; the update's device defaults to where the policy is."""
    from lit_rlvr.update.forward import forward_logprobs

    probe, rollouts = DeviceProbe(), batch()
    logp, _ = forward_logprobs(probe, rollouts, temperature=TEMPERATURE, device="meta")
    assert probe.seen.type == logp.device.type == "meta" and logp.shape == rollouts.response_ids.shape
    logp, _ = forward_logprobs(probe, rollouts, temperature=TEMPERATURE)
    assert probe.seen.type == logp.device.type == "cpu"
    policy = load_policy(policy_dir)[0].to("meta")
    made = dict(loss=LOSS, update=UPDATE, grad_clip=1.0, temperature=TEMPERATURE, norm_len=MAX_NEW_TOKENS,
                policy_loss=ppo_clip)
    assert Update(policy, None, **made).device == torch.device("meta")
    assert Update(policy, None, **made, device="cpu").device == "cpu"


def test_positions_count_from_each_rows_first_token_whatever_its_left_padding():
    """The k-th token of a row's sequence is at position k, whatever the row's left padding (which sits at 0): a model
    with learned absolute positions sees each sequence as it would alone."""
    from lit_rlvr.update.forward import forward_logprobs

    rollouts = batch()
    pad = torch.tensor([0, 2, 4, 1, 0, 3, 2, 1])[:, None]  # left padding of each row's 5-token prompt
    rollouts = replace(rollouts, prompt_mask=torch.arange(5) >= pad)
    probe = DeviceProbe()
    forward_logprobs(probe, rollouts, temperature=TEMPERATURE)
    in_sequence = torch.cat([rollouts.prompt_mask, rollouts.response_attention_mask], dim=1)  # [n, P+T]
    k_th = (torch.arange(5 + MAX_NEW_TOKENS) - pad).expand_as(in_sequence)  # the k-th token of its sequence: k
    assert torch.equal(probe.positions[in_sequence], k_th[in_sequence])
    assert torch.equal(probe.positions[:, :5][~rollouts.prompt_mask], torch.zeros(int(pad.sum()), dtype=torch.long))
