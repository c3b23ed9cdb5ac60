"""`model.compile=true`: the update's forward and backward through torch.compile (docs/mfu.md). What must hold on
any machine: the compiled policy computes the eager one's log-probs and gradients (up to float reassociation), it
shares the policy's parameters (a step moves the weights the checkpoint saves), and micro-batches of other widths
reuse the compiled graph instead of failing."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.update import forward_logprobs
from tiny_options import TINY


def compiled_module(**kwargs) -> GRPOModule:
    return GRPOModule(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=6, seed=1, lr=3e-3,
                      compile_update=True, **kwargs)


def rollouts(width: int, rows: int = 4) -> Rollouts:
    """Rows of random tokens, the first row's prompt left-padded and its response cut short."""
    torch.manual_seed(width)
    prompt_mask = torch.ones(rows, 5, dtype=torch.bool)
    prompt_mask[0, :2] = False
    response_mask = torch.ones(rows, width, dtype=torch.bool)
    response_mask[0, width // 2 :] = False
    return Rollouts(prompt_ids=torch.randint(1, 20, (rows, 5)), prompt_mask=prompt_mask,
                    response_ids=torch.randint(1, 20, (rows, width)), response_mask=response_mask,
                    old_logp=torch.zeros(rows, width), group=torch.zeros(rows, dtype=torch.long),
                    source=torch.zeros(rows, dtype=torch.long), num_groups=1, prompts=["p"], answers=[0],
                    rewards=torch.zeros(rows), malformed=torch.zeros(rows, dtype=torch.bool))


def logprobs_and_grads(module: GRPOModule, model, batch: Rollouts) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.policy.zero_grad()
    logp, _ = forward_logprobs(model, batch, temperature=module.algorithm.temperature)
    (logp * batch.response_mask).sum().backward()
    return logp.detach(), [p.grad.clone() for p in module.policy.parameters() if p.requires_grad]


@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["full", "lora"])
def test_compiled_update_computes_the_eager_log_probs_and_gradients_at_any_width(lora):
    module = compiled_module(lora=lora)
    compiled = module.update_policy()
    assert compiled is not module.policy and compiled is module.update_policy()  # compiled once, then reused
    for width in (6, 9):  # a second width: dynamic shapes, no failure
        eager_logp, eager_grads = logprobs_and_grads(module, module.policy, rollouts(width))
        logp, grads = logprobs_and_grads(module, compiled, rollouts(width))
        torch.testing.assert_close(logp, eager_logp, atol=1e-5, rtol=1e-5)
        for g, eager in zip(grads, eager_grads, strict=True):  # fused kernels sum in another order: per tensor
            assert (g - eager).norm() <= 1e-4 * eager.norm()
    # the wrapper is not a submodule: checkpoints hold the policy's keys only
    assert not any("_orig_mod" in k or "_compiled" in k for k in module.state_dict())


def test_a_compiled_run_trains_the_policy_it_saves():
    module = compiled_module()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    data = RLVRDataModule(task="arithmetic", batch_size=2, eval_batch_size=16, num_train=64, num_test=16, seed=1)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    assert "policy" in module._compiled  # the update ran through the compiled policy
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    assert torch.isfinite(module.step_metrics["loss/policy"])


def test_compile_update_must_be_a_bool():
    """`compile_update="no"` would be truthy: refused with the config key's one line, before the model loads."""
    with pytest.raises(ConfigError, match=r"model.compile='no' is not valid: expected true or false"):
        GRPOModule(model="tiny", model_options=dict(TINY), compile_update="no")


def test_train_py_refuses_compile_with_fsdp_before_any_work():
    """train.py's config check names it before the model loads (the module's setup check is for the CLI)."""
    from hydra import compose, initialize_config_dir

    from lit_rlvr.app.config_check import check_config
    from tiny_options import REPO

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["trainer=fsdp", "model.compile=true"])
    with pytest.raises(ConfigError, match=r"model.compile=True is not valid: expected false with a sharding"):
        check_config(cfg)


def test_compile_is_refused_with_a_sharding_strategy():
    module = compiled_module()
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(parallelize=lambda m: None), callbacks=[],
                                      world_size=1)
    with pytest.raises(ConfigError, match=r"model.compile=True is not valid: expected false with a sharding"):
        module.setup("fit")
