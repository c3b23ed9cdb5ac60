"""LoRA on the policy (lit_rlvr.models.lora): the option's one owner and its errors, what trains and what the
optimizer holds, and the exactness rules: at step 0 the LoRA policy's log-probs equal the base's bit for bit, the
KL reference is the base with the adapter off, merged and unmerged log-probs agree to fp32 rounding after
training, and merge-then-unmerge restores the base bit for bit."""

from __future__ import annotations

import pytest
import torch

from lit_rlvr.models import load_policy
from lit_rlvr.config.settings import LoraOptions
from lit_rlvr.models.lora import (apply_lora, base_model, is_lora, lora_layers, merged_adapter,
                                  reference_model, trainable_parameters)
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.rollout.engine import SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.update import forward_logprobs
from tiny_options import TINY as TINY_OPTIONS

PROMPTS = ["12+34=", "5+5=", "71-18=", "3*4="]


def lora_module(rank: int = 4, **kwargs) -> GRPOModule:
    return GRPOModule(model="tiny", model_options=dict(TINY_OPTIONS), group_size=4, max_new_tokens=6,
                      lora={"rank": rank}, **kwargs)


def batch(tokenizer, model, n: int = 2) -> Rollouts:
    """Completions sampled from `model` for PROMPTS (greedy), as a Rollouts for `lit_rlvr.update.forward_logprobs`."""
    from lit_rlvr.rollout.batch import RolloutPlan, rollouts_from_completions

    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    completions = engine.generate(ids, [n] * len(ids), SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))
    plan = RolloutPlan(PROMPTS, [0] * len(PROMPTS), ids, [n] * len(ids))
    return rollouts_from_completions(plan, completions, source=0, pad_id=tokenizer.pad_token_id)


def randomise_adapters(model, scale: float = 0.2, seed: int = 0) -> None:
    """B ≠ 0 (a trained adapter): the adapter now changes what the model computes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


# -- the option ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, key", [({"rank": 0}, "model.lora.rank"), ({"rank": 2.5}, "model.lora.rank"),
                                        ({"rank": 4, "alpha": 0}, "model.lora.alpha"),
                                        ({"rank": 4, "dropout": 1.0}, "model.lora.dropout"),
                                        ({"rank": 4, "lr_scale": -1}, "model.lora.lr_scale"),
                                        ({"rank": 4, "target_modules": "attention"}, "model.lora.target_modules"),
                                        ({"rnak": 4}, "model.lora.rnak")])
def test_bad_options_name_their_key(value, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        LoraOptions.from_any(value)


def test_defaults_are_full_fine_tuning_and_the_study_settings():
    assert not LoraOptions.from_any(None).enabled and not LoraOptions.from_any({"rank": None}).enabled
    options = LoraOptions.from_any({"rank": 8})
    assert (options.alpha, options.target_modules, options.dropout, options.lr_scale) == (32.0, "all-linear", 0.0, 10.0)


def test_bad_target_names_the_key(tiny_path):
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules"):
        apply_lora(load_policy(tiny_path)[0], LoraOptions(rank=2, target_modules=("no_such_proj",)))


def test_config_check_refuses_bad_lora_before_any_work():
    from hydra import compose, initialize_config_dir
    from tiny_options import REPO

    from lit_rlvr.app.config_check import check_config
    from lit_rlvr.config.errors import ConfigError

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        check_config(cfg)


# -- what trains ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "ivon"])
def test_only_adapters_train_and_the_optimizer_holds_them_alone(optimizer):
    extra = {"optimizer": "ivon", "grad_clip": 0.0, "lr": 0.03, "optimizer_options": {"ess": 1e8}} \
        if optimizer == "ivon" else {}
    module = lora_module(rank=4, **extra)
    assert is_lora(module.policy)
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every projection of every block has an adapter, the tied output head none
    assert len(list(lora_layers(module.policy))) == 7 * module.policy.config.num_hidden_layers
    opt = module.configure_optimizers()["optimizer"]
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in trainable_parameters(module.policy)}
    assert opt.param_groups[0]["lr"] == pytest.approx(module.algorithm.lr * 10)  # lr_scale: the ~10x rule
    if optimizer == "ivon":
        assert opt.noise_stats()["noise/numel"] == sum(p.numel() for p in held)


def test_adapter_init_depends_on_the_seed_alone(tiny_path):
    def adapters(seed: int) -> list[torch.Tensor]:
        torch.randn(7)  # the global RNG moves between builds: it must not matter
        model = apply_lora(load_policy(tiny_path)[0], LoraOptions(rank=2), seed=seed)
        return [p.detach().clone() for p in trainable_parameters(model)]

    first, again, other = adapters(1), adapters(1), adapters(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_full_fine_tuning_is_unchanged_by_the_option():
    module = GRPOModule(model="tiny", model_options=dict(TINY_OPTIONS), group_size=4, lora={"rank": None})
    assert not is_lora(module.policy)
    opt = module.configure_optimizers()["optimizer"]
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in module.policy.parameters())
    assert opt.param_groups[0]["lr"] == module.algorithm.lr


# -- exactness -----------------------------------------------------------------------------------------------------
def test_step0_lora_logprobs_equal_the_base_model_exactly(tiny_path):
    base, tokenizer = load_policy(tiny_path)
    module = lora_module(rank=8)
    rollouts = batch(tokenizer, base)
    with torch.no_grad():
        want, _ = logprobs(module, base, rollouts)
        got, _ = logprobs(module, module.policy, rollouts)
    assert torch.equal(got, want)  # B = 0: base + 0, bit for bit


def test_hf_engine_samples_a_lora_policy_like_its_base_at_step0(tiny_path):
    """The engine finds the KV-cache argument under the peft wrapper (else each decode step would see one token)."""
    base, tokenizer = load_policy(tiny_path)
    module = lora_module(rank=8)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    want = HFEngine(base, pad_id=pad, eos_id=eos).generate(ids, [3] * 4, params)
    got = HFEngine(module.policy, pad_id=pad, eos_id=eos).generate(ids, [3] * 4, params)
    for g_b, w_b in zip(got, want):
        for g, w in zip(g_b, w_b):
            assert torch.equal(g.token_ids, w.token_ids)
            # peft's wrapper computes the kept logits over another slice: rounding, not the adapter (B = 0)
            torch.testing.assert_close(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


def test_kl_reference_is_the_base_with_the_adapter_off(tiny_path):
    base, tokenizer = load_policy(tiny_path)
    module = lora_module(rank=4, kl_coef=0.1)
    assert module.ref_policy is None  # no second copy of the weights
    randomise_adapters(module.policy)
    rollouts = batch(tokenizer, base)
    with torch.no_grad():
        want, _ = logprobs(module, base, rollouts)
        policy_logp, _ = logprobs(module, module.policy, rollouts)
    ref, adapter_off = reference_model(module.policy, module.ref_policy)
    with torch.no_grad(), adapter_off:
        assert torch.equal(logprobs(module, ref, rollouts)[0], want)
    assert not torch.allclose(policy_logp, want, atol=1e-3)  # the adapter does change the policy
    loss, metrics = module.make_update().micro_batch_loss(_scored(rollouts), 1.0)
    assert float(metrics["loss/kl_ref"]) > 0


def logprobs(module: GRPOModule, model, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """The update's forward of `model` at the module's sampling temperature: log-probs [n, T], logits."""
    return forward_logprobs(model, rollouts, temperature=module.algorithm.temperature)


def _scored(rollouts: Rollouts) -> Rollouts:
    rollouts.advantages = torch.linspace(-1, 1, rollouts.num_samples)
    return rollouts


def test_merged_and_unmerged_logprobs_agree_and_unmerge_restores_the_base_bit_for_bit(tiny_path):
    base, tokenizer = load_policy(tiny_path)
    module = lora_module(rank=8)
    randomise_adapters(module.policy)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    rollouts = batch(tokenizer, base)
    with torch.no_grad():
        unmerged, _ = logprobs(module, module.policy, rollouts)
        with merged_adapter(module.policy):
            merged, _ = logprobs(module, module.policy, rollouts)
            changed = [n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])]
        after, _ = logprobs(module, module.policy, rollouts)
    assert changed and all("base_layer" in n for n in changed)  # the merge did write W + ΔW
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=2e-5)  # fp32 rounding of W + ΔW
    assert all(torch.equal(p, before[n]) for n, p in module.policy.named_parameters())  # bit for bit
    assert torch.equal(after, unmerged)
    assert not any(layer.merged for _, layer in lora_layers(module.policy))


def test_base_model_is_the_transformers_model():
    module = lora_module(rank=2)
    assert type(base_model(module.policy)).__name__ == "Qwen3ForCausalLM"
