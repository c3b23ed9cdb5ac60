"""LoRA policies reaching a rollout engine (lit_rlvr.rollout.lora) on the HF engine in `copy` mode, the same path a
server takes: `lora_sync=adapter` pushes the adapter tensors alone, `merged` pushes W + BA under the base names
(only the adapted layers once the engine holds the rest); after every push `engine/sync_logp_diff` compares the
engine's log-probs with the trainer's, and an engine that drops a push stops the run with `EngineSyncError`."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.models.lora import is_lora, lora_layers
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.lora import EngineSyncError, adapter_name, hf_name, push_bytes
from tiny_options import TINY


def lora_module(engine_options: dict, **kwargs) -> GRPOModule:
    args = dict(model="tiny", model_options=dict(TINY), group_size=4, max_new_tokens=4, lora={"rank": 4},
                engine_options=engine_options, seed=1, lr=3e-3)
    return GRPOModule(**{**args, **kwargs})


def fit(module: GRPOModule, steps: int, callbacks=()) -> list[dict]:
    rows = []
    real = module._log_step
    module._log_step = lambda *a: (real(*a), rows.append({k: float(v) for k, v in module.step_metrics.items()}))[0]
    data = RLVRDataModule(task="arithmetic", batch_size=2, eval_batch_size=16, num_train=64, num_test=16, seed=1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=list(callbacks),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    return rows


def spy(module: GRPOModule, method: str, drop_after: int | None = None) -> list:
    """Record the engine's `method` calls (set up with the engine); from call `drop_after` on, drop them."""
    calls = []
    real_setup = module.setup

    def setup(stage):
        real_setup(stage)
        real = getattr(module.engine, method)

        def recorded(*args):  # tensors cloned: a push may hand over views of the live parameters
            calls.append(tuple({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
                               if isinstance(a, dict) else a for a in args))
            if drop_after is None or len(calls) <= drop_after:
                return real(*args)
            return None  # a push that never arrives

        setattr(module.engine, method, recorded)

    module.setup = setup
    return calls


def test_adapter_sync_pushes_the_adapter_alone_and_the_engine_follows():
    module = lora_module({"mode": "copy", "lora_sync": "adapter"})
    loads, adapters = spy(module, "load_weights"), spy(module, "load_adapter")
    rows = fit(module, steps=3)
    assert not loads  # the copy holds the base: nothing else is ever sent
    # one per weight version: 0 (before the first step), then after each of the 3 steps
    assert [a[0] for a in adapters] == [adapter_name(v, push=0) for v in range(4)]
    adapter_bytes = sum(p.numel() * 4 for p in module.policy.parameters() if p.requires_grad)
    assert all(sum(t.numel() * t.element_size() for t in a[1].values()) == adapter_bytes for a in adapters)
    trained = {n: p for n, p in module.policy.named_parameters() if p.requires_grad}
    served = dict(module.engine.model.named_parameters())
    assert all(torch.equal(served[n], p) for n, p in trained.items())
    assert any(bool(p.abs().sum() > 0) for n, p in trained.items() if "lora_B" in n)  # the adapter moved
    diffs = [r["engine/sync_logp_diff"] for r in rows]
    assert len(diffs) == 3 and max(diffs) < 1e-4  # fp32 on both sides: rounding only


def test_merged_sync_pushes_the_adapted_layers_after_the_first_push():
    module = lora_module({"mode": "copy", "lora_sync": "merged"})
    module.setup("fit")
    engine = module.engine
    assert not is_lora(engine.model)  # a plain model under the base's names, as a server holds it
    pushes: list[set[str]] = [set()]
    load, end = engine.load_weights, engine.end_weight_update
    engine.load_weights = lambda bucket: (pushes[-1].update(n for n, _ in bucket), load(bucket))[1]
    engine.end_weight_update = lambda: (pushes.append(set()), end())[1]
    module.driver.push(step=0)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    module.driver.push(step=1)
    adapted = {hf_name(f"{n}.base_layer.weight") for n, _ in lora_layers(module.policy)}
    assert pushes[0] == set(dict(engine.model.named_parameters()))  # first: everything
    assert pushes[1] == adapted  # then only W + BA of the adapted layers
    served = dict(engine.model.named_parameters())
    for name, layer in lora_layers(module.policy):
        want = layer.base_layer.weight + layer.get_delta_weight("default")
        torch.testing.assert_close(served[hf_name(f"{name}.base_layer.weight")], want, rtol=0, atol=1e-6)
    rows = fit(lora_module({"mode": "copy", "lora_sync": "merged"}), steps=2)
    assert max(r["engine/sync_logp_diff"] for r in rows) < 1e-4


@pytest.mark.parametrize("sync, method", [("adapter", "load_adapter"), ("merged", "load_weights")])
def test_an_engine_that_drops_a_push_stops_the_run(sync, method):
    module = lora_module({"mode": "copy", "lora_sync": sync}, lr=0.05)
    spy(module, method, drop_after=1)  # the first push arrives, the next ones never do
    with pytest.raises(EngineSyncError, match="not sampling the policy being trained"):
        fit(module, steps=4)
    assert module.global_step >= 1  # it trained, then stopped at a push that did not arrive


def test_c3po_on_a_copy_engine_pushes_each_sampled_adapter():
    from lit_rlvr.callbacks import ParamNoise

    module = lora_module({"mode": "copy"}, optimizer="ivon", grad_clip=0.0, lr=0.03, seq_mask_tau=2.0,
                         optimizer_options={"ess": 1e8, "hess_init": 1e-3, "weight_decay": 1e-6})
    adapters = spy(module, "load_adapter")
    rows = fit(module, steps=2, callbacks=[ParamNoise("c3po", num_samples=2)])
    # per step: the two samples (pushed one at a time in copy mode), then the new mean after the IVON step
    names = [a[0] for a in adapters]
    assert names == [adapter_name(0, push=0), adapter_name(0, push=1), adapter_name(1, push=0),
                     adapter_name(1, push=1), adapter_name(1, push=2), adapter_name(2, push=0)]
    assert not torch.equal(*(next(iter(a[1].values())) for a in adapters[:2]))  # two different samples
    assert all(r["engine/sync_logp_diff"] < 1e-4 for r in rows)
    assert rows[-1]["noise/numel"] == sum(p.numel() for p in module.policy.parameters() if p.requires_grad)


def test_bad_lora_sync_names_the_key():
    with pytest.raises(ValueError, match=r"engine\.options\.lora_sync"):
        lora_module({"mode": "copy", "lora_sync": "both"}).setup("fit")


def test_qwen3_4b_adapter_push_is_under_2_percent_of_the_full_weights():
    """The budget, counted from the parameter shapes of the qwen3_4b config (meta device: no weights)."""
    from lit_rlvr.config.settings import LoraOptions
    from lit_rlvr.models.lora import apply_lora
    from lit_rlvr.models.reference_configs import qwen3_4b_config

    with torch.device("meta"):
        from transformers import Qwen3ForCausalLM

        model = Qwen3ForCausalLM(qwen3_4b_config())
    full = push_bytes(model, lora_sync="adapter", first=False, dtype=torch.bfloat16)
    assert 7.5e9 < full < 8.5e9  # ~4.0B parameters in bf16
    lora = apply_lora(model, LoraOptions(rank=32))
    adapter = push_bytes(lora, lora_sync="adapter", first=False, dtype=torch.bfloat16)
    assert adapter / full <= 0.02
    assert push_bytes(lora, lora_sync="merged", first=False, dtype=torch.bfloat16) / full > 0.5


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_a_sampled_adapter_pushed_from_a_snapshot_is_what_a_push_with_it_in_place_sends(sync):
    """3PO in async mode on LoRA: the producer pushes adapter values drawn at plan time (`push_named`) while the
    trainer's adapters move on. The engine must then hold what the synchronous run sends with that sample written
    into the policy (`push`), bit for bit: the same tensors through the same ops."""
    snapshot, in_place = (lora_module({"mode": "copy", "lora_sync": sync}) for _ in range(2))
    for module in (snapshot, in_place):
        module.setup("fit")
    adapters = [n for n, p in snapshot.policy.named_parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    params = dict(snapshot.policy.named_parameters())
    sample = {n: params[n].detach() + 0.1 * torch.randn(params[n].shape, generator=generator) for n in adapters}
    with torch.no_grad():  # the trainer moves on: the producer must not read the policy's adapters
        for n in adapters:
            params[n].add_(1.0)
        in_place_params = dict(in_place.policy.named_parameters())
        for n in adapters:
            in_place_params[n].copy_(sample[n])
    snapshot.driver.weight_sync.push_named(sample.items(), step=0)
    in_place.driver.weight_sync.push(step=0, holds_mean=False)
    held, want = (dict(m.engine.model.named_parameters()) for m in (snapshot, in_place))
    assert held.keys() == want.keys() and all(torch.equal(held[n], want[n]) for n in want)
    assert snapshot.driver.weight_sync.version == 0 and not snapshot.driver.weight_sync.holds(0)


def test_the_sync_bound_follows_the_trainers_compute_dtype_too():
    """FSDP's mixed precision keeps fp32 weights and computes in bf16: the bound is then bf16's (0.5), not the fp32
    engine's (0.02) (found on an H200: C3PO under trainer=fsdp stopped at a 0.032 gap, bf16 rounding alone)."""
    from lit_rlvr.rollout.engine import Completion
    from lit_rlvr.rollout.lora import SyncCheck, check_engine_sync

    class Policy(torch.nn.Module):  # fp32 weights; logits rounded through bf16, as FSDP's param_dtype computes
        def __init__(self, dtype):
            super().__init__()
            self.weight, self.dtype = torch.nn.Parameter(torch.zeros(4)), dtype

        def forward(self, input_ids):
            logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(input_ids.shape[1], 1)[None]
            return type("Out", (), {"logits": logits.to(self.dtype)})

    class Engine:  # samples token 3 with a log-prob 0.03 off the trainer's
        def generation_dtype(self):
            return torch.float32

        def generate(self, prompts, counts, params):
            logp = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]), -1)[3] + 0.03
            return [[Completion(torch.tensor([3, 3]), torch.full((2,), float(logp)), "length")]]

    check = SyncCheck()
    assert 0.02 < float(check_engine_sync(Engine(), Policy(torch.bfloat16), [1], check=check, version=0)) < 0.5
    with pytest.raises(EngineSyncError, match="differ from the trainer's by 0.03"):
        check_engine_sync(Engine(), Policy(torch.float32), [1], check=check, version=0)
