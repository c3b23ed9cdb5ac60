"""The rollout correction in GRPOModule with the real HF engine: `mismatch/*` measures the engine's drift (0 for the
fp32 shared engine, > 0 for a bf16 copy, larger for a copy that missed a push), decoupled mode's extra forward
leaves the gradient as it is when there is no mismatch, the corrections reach the loss and do not depend on
micro-batching, and the HF engine's `dtype` option."""

from __future__ import annotations

import os
from dataclasses import replace
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch

from lit_rlvr.config.rollout_correction import RolloutCorrection
from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.weight_sync import WeightSync
from lit_rlvr.rollout.weights import push_weights
from lit_rlvr.update import forward_logprobs
from tiny_options import TINY as TINY_OPTIONS

TINY = {"cache_dir": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr"), **TINY_OPTIONS}  # = conf/model/tiny.yaml


def module(**kwargs) -> GRPOModule:
    """The tiny model with conf/algorithm/grpo.yaml's lr (a step moves the weights as the default run's do)."""
    return GRPOModule(model="tiny", model_options=dict(TINY), **{"group_size": 4, "max_new_tokens": 6, "lr": 3e-4,
                                                                  **kwargs})


# -- whole steps with the real engine ---------------------------------------------------------------------------
class StepMetrics(RLVRCallback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in pl_module.step_metrics.items()})


def fit(steps: int = 2, drop_push_at: int | None = None, **kwargs) -> list[dict]:
    """`steps` RL steps of 4 prompts × 4 samples; `drop_push_at`: the engine ignores the weights pushed after that
    optimizer step (it keeps sampling with the previous ones while claiming the new version)."""
    pl.seed_everything(0, verbose=False)
    m = module(**kwargs)
    real = WeightSync._send

    def send(sync, step):
        if step == drop_push_at:
            return 0  # a lost push: the engine keeps sampling with the previous weights under the new version
        return real(sync, step)

    metrics = StepMetrics()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[metrics])
    with mock.patch.object(WeightSync, "_send", send):
        trainer.fit(m, datamodule=RLVRDataModule(batch_size=4, seed=0))
    assert len(metrics.rows) == steps
    return metrics.rows


@pytest.fixture(scope="module")
def runs():
    return {
        "shared": fit(),
        "copy_bf16": fit(engine_options={"mode": "copy", "dtype": "bfloat16"}),
        "copy_stale": fit(steps=3, drop_push_at=1,  # the post-push check would stop this run: off
                          engine_options={"mode": "copy", "sync_check_every": 0}),
        "decoupled_bf16": fit(engine_options={"mode": "copy", "dtype": "bfloat16"},
                              rollout_correction={"rollout_is": "token", "rollout_rs": "sequence"}),
    }


def test_every_run_logs_the_mismatch(runs):
    for name, rows in runs.items():
        for row in rows:
            assert {"mismatch/kl", "mismatch/ppl_ratio", "mismatch/is_weight_max"} <= row.keys(), name
            assert row["mismatch/kl"] >= 0 and row["mismatch/is_weight_max"] > 0, name


def test_fp32_shared_engine_computes_what_the_trainer_computes(runs):
    """The HF engine samples with the trainer's own fp32 weights: its log-probs are the training forward's up to
    float rounding (|log r| ~ 1e-6), so k3 ~ 1e-12 and every ratio is 1."""
    for row in runs["shared"]:
        assert row["mismatch/kl"] < 1e-10
        assert row["mismatch/ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
        assert row["mismatch/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert "mismatch/rs_masked_frac" not in runs["shared"][0]  # only when rejection is on


def test_bf16_copy_engine_drifts_from_the_fp32_trainer(runs):
    shared = max(r["mismatch/kl"] for r in runs["shared"])
    for row in runs["copy_bf16"]:
        assert row["mismatch/kl"] > 1e-6 > 1000 * shared  # bf16 weights: far above float rounding
        assert row["mismatch/is_weight_max"] > 1.001


def test_a_dropped_push_shows_as_a_larger_mismatch(runs):
    """fp32 copy engine: steps 1 and 3 sample with the trainer's weights (no drift); the push after step 1 is
    lost, so step 2 samples with step 0's weights while the trainer has taken a step."""
    first, stale, fresh = runs["copy_stale"]
    assert first["mismatch/kl"] < 1e-10 and fresh["mismatch/kl"] < 1e-10
    assert stale["mismatch/kl"] > 1e-6 > 1000 * max(first["mismatch/kl"], fresh["mismatch/kl"])


def test_decoupled_mode_logs_its_extra_forward_and_correction(runs):
    for row in runs["decoupled_bf16"]:
        assert row["time/old_logp_s"] > 0
        assert 0 <= row["mismatch/is_clip_frac"] <= 1 and 0 <= row["mismatch/rs_masked_frac"] <= 1
        assert row["mismatch/kl"] > 1e-6
    assert "time/old_logp_s" not in runs["copy_bf16"][0]  # bypass mode: no extra forward


# -- the update on a fixed batch ----------------------------------------------------------------------------------
def batch(m: GRPOModule, shift: float, far: float) -> Rollouts:
    """8 completions of 2 prompts, responses of 1–6 tokens; the engine's log-probs are the policy's own moved by
    `shift` per token, and by `far` per token for completions 1 and 6."""
    g = torch.Generator().manual_seed(0)
    n, p, t = 8, 5, 6
    lengths = torch.tensor([1, 6, 3, 4, 2, 5, 6, 3])
    rollouts = Rollouts(
        prompt_ids=torch.randint(4, 90, (n, p), generator=g), prompt_mask=torch.ones(n, p, dtype=torch.bool),
        response_ids=torch.randint(4, 90, (n, t), generator=g), response_mask=torch.arange(t) < lengths[:, None],
        old_logp=torch.zeros(n, t), group=torch.arange(n) // 4, source=torch.zeros(n, dtype=torch.long),
        num_groups=2, prompts=["a", "b"], answers=[0, 0], advantages=torch.randn(n, generator=g))
    with torch.no_grad():
        logp, _ = forward_logprobs(m.policy, rollouts, temperature=m.algorithm.temperature)  # [n, t]
    moved = torch.full((n, 1), shift)
    moved[[1, 6]] = far
    rollouts.old_logp = (logp - moved) * rollouts.response_mask
    return rollouts


def gradient(m: GRPOModule, rollouts: Rollouts, micro_batch_size: int = 8) -> tuple[torch.Tensor, dict]:
    """The gradient of one update's loss pass, as `Update.run` computes it (correction before, then the
    micro-batches; no trainer: plain autograd), and the metrics of the correction and the pass."""
    m.algorithm = replace(m.algorithm, micro_batch_size=micro_batch_size)
    update = m.make_update()
    m.policy.zero_grad()
    corrected, metrics = update.correct(rollouts)
    sums: dict = {}
    update.backward_pass(corrected, 0, sums)
    metrics.update(update.correction.first_pass_metrics())
    grad = torch.cat([q.grad.flatten() for q in m.policy.parameters() if q.grad is not None])
    return grad, {**{k: float(v) for k, v in metrics.items()}, **{k: float(v) for k, v in sums.items()}}


def test_decoupled_mode_without_mismatch_gives_todays_gradient():
    """bypass_mode=false recomputes π_old with an extra forward; when the engine computed what the trainer does
    (engine log-probs = the policy's, up to float rounding) the loss and gradient are today's."""
    m = module()
    rollouts = batch(m, shift=0.0, far=0.0)
    today, _ = gradient(m, rollouts)
    m.algorithm = replace(m.algorithm, rollout_correction=RolloutCorrection(bypass_mode=False))
    decoupled, metrics = gradient(m, rollouts)
    torch.testing.assert_close(decoupled, today, rtol=1e-5, atol=1e-7)
    assert metrics["mismatch/kl"] < 1e-12 and m.timer.times["old_logp_s"] > 0
    m.algorithm = replace(m.algorithm, rollout_correction=RolloutCorrection(rollout_is="token", rollout_rs="token"))
    corrected, _ = gradient(m, rollouts)  # no mismatch: weights 1, nothing rejected
    torch.testing.assert_close(corrected, today, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("options", [{"rollout_is": "token"}, {"rollout_is": "sequence", "rollout_is_threshold": 1.5},
                                     {"rollout_is": "token", "rollout_rs": "geometric", "rollout_rs_threshold": 1.03},
                                     {"rollout_rs": "token_k3,seq_sum_k1", "rollout_rs_threshold": "0.001,2.0",
                                      "bypass_mode": True}])
def test_corrections_change_the_gradient_and_not_with_micro_batching(options):
    m = module(rollout_correction=options)
    rollouts = batch(m, shift=0.02, far=1.0)
    whole, metrics = gradient(m, rollouts, micro_batch_size=8)
    for size in (3, 1):
        part, _ = gradient(m, rollouts, micro_batch_size=size)
        # decoupled mode recomputes π_old in this micro-batch layout too: its float rounding reaches the weights
        torch.testing.assert_close(part, whole, rtol=1e-4, atol=5e-7)
    plain = module()
    baseline, _ = gradient(plain, rollouts)
    assert not torch.allclose(whole, baseline, rtol=1e-3, atol=1e-6)  # the correction reached the loss
    assert metrics["mismatch/kl"] > 0.01  # two completions 1 nat per token away


def test_sequence_rejection_in_bypass_mode_is_3pos_sequence_mask():
    """verl's `rollout_rs=sequence` at 2 with the engine's log-probs as π_old drops exactly the sequences whose
    ratio leaves [1/2, 2], with their tokens left in the normalisers: the loss of 3PO's `seq_mask_tau=2`."""
    rs = module(rollout_correction={"rollout_rs": "sequence", "rollout_rs_threshold": 2.0, "bypass_mode": True})
    rollouts = batch(rs, shift=0.02, far=1.0)
    grad_rs, metrics = gradient(rs, rollouts)
    grad_mask, mask_metrics = gradient(module(seq_mask_tau=2.0), rollouts)
    torch.testing.assert_close(grad_rs, grad_mask, rtol=1e-6, atol=1e-8)
    assert metrics["mismatch/rs_masked_frac"] == pytest.approx(12 / 30)  # completions 1 and 6: 6 + 6 of 30 tokens
    assert mask_metrics["loss/seq_mask_frac"] == pytest.approx(2 / 8)


class OwnLoss(GRPOModule):
    """A subclass's loss that does not say it applies the correction's token weights."""

    def policy_loss(self, logp, old_logp, advantages, mask, rollouts):
        from lit_rlvr import functional as F

        return F.ppo_clip_loss(logp, old_logp, advantages, mask)


def test_options_are_checked_by_the_constructor_and_a_loss_without_token_weights_is_refused():
    with pytest.raises(ValueError, match=r"algorithm\.rollout_correction\.rollout_is='tok'"):
        module(rollout_correction={"rollout_is": "tok"})
    with pytest.raises(ValueError, match="OwnLoss.policy_loss does not apply rollouts.token_weights"):
        OwnLoss(model="tiny", model_options=dict(TINY), rollout_correction={"rollout_rs": "sequence"})
    OwnLoss(model="tiny", model_options=dict(TINY))  # metrics only: fine
    module(policy_loss="gspo", rollout_correction={"rollout_is": "token"})  # every named loss takes token weights


def test_3po_refuses_decoupled_mode_before_any_work():
    from lit_rlvr.callbacks import ParamNoise

    options = dict(optimizer="ivon", group_size=4, seq_mask_tau=2.0, rollout_correction={"rollout_rs": "sequence"})
    with pytest.raises(ValueError, match="bypass_mode=true"):
        ParamNoise(variant="c3po", num_samples=2).check_algorithm(AlgorithmConfig(**options))
    bypass = dict(options, rollout_correction={"rollout_rs": "sequence", "bypass_mode": True})
    ParamNoise(variant="c3po", num_samples=2).check_algorithm(AlgorithmConfig(**bypass))  # composes with the mask


# -- HFEngine(dtype=...) ---------------------------------------------------------------------------------------------
def test_copy_engine_keeps_its_weights_in_its_dtype_and_pushes_are_cast(tiny_path):
    from lit_rlvr.models import load_policy

    model, _ = load_policy(tiny_path)
    engine = HFEngine(model, pad_id=0, eos_id=2, mode="copy", dtype="bfloat16")
    assert engine.weight_dtype == torch.bfloat16 and engine.generation_dtype() == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the trainer's stay fp32
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.001)
    push_weights(engine, model, dtype=engine.weight_dtype)
    for (name, p), q in zip(model.named_parameters(), engine.model.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.detach().to(torch.bfloat16)), name
    assert HFEngine(model, pad_id=0, eos_id=2, mode="copy").weight_dtype is None  # default: as before
    with pytest.raises(ValueError, match=r"engine\.options\.dtype=bfloat16 needs engine\.options\.mode=copy"):
        HFEngine(model, pad_id=0, eos_id=2, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"engine\.options\.dtype='int8' is not a floating torch dtype"):
        HFEngine(model, pad_id=0, eos_id=2, mode="copy", dtype="int8")
