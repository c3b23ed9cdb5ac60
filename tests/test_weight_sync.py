"""`WeightSync` (lit_rlvr/rollout/weight_sync.py): the one owner of what an engine holds of the policy. It decides
when a rollout needs a push, brings the base again after a sleep freed it, names adapters per push, and writes
nothing on the engine."""

from __future__ import annotations

import pytest
import torch

from lit_rlvr.models import load_policy
from lit_rlvr.config.settings import LoraOptions
from lit_rlvr.models.lora import apply_lora
from lit_rlvr.rollout.engine import RolloutEngine, SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.lora import adapter_name
from lit_rlvr.rollout.weight_sync import WeightSync


class ServerLike(RolloutEngine):
    """An engine started without weights whose sleep frees them (SGLang's, vLLM's at level 2); records pushes."""

    serves_lora = serves_many_adapters = can_generate_stacked = True

    def __init__(self):
        self.calls: list[tuple] = []
        self._has_weights = False

    @property
    def holds_weights(self) -> bool:
        return self._has_weights

    def load_weights(self, named_tensors):
        self.calls.append(("weights", len(list(named_tensors))))

    def end_weight_update(self):
        self._has_weights = True

    def load_adapter(self, name, tensors, config, activate=True):
        self.calls.append(("adapter", name, activate))

    def sleep(self):
        self._has_weights = False


@pytest.fixture(scope="module")
def lora_policy(tiny_path):
    return apply_lora(load_policy(tiny_path)[0], LoraOptions(rank=2), seed=0)


def test_base_once_adapters_per_push_and_the_base_again_after_a_sleep(lora_policy):
    engine = ServerLike()
    sync = WeightSync(engine, lora_policy)
    assert not sync.holds(0)
    first = sync.push(step=0)
    assert [c[0] for c in engine.calls] == ["weights", "adapter"] and sync.holds(0)
    assert engine.calls[-1] == ("adapter", adapter_name(0, push=0), True) == ("adapter", sync.adapter, True)
    engine.calls.clear()
    second = sync.push(step=0, holds_mean=False)  # a 3PO sample pushed alone: the adapter only, a new name
    assert engine.calls == [("adapter", adapter_name(0, push=1), True)] and not sync.holds(0)
    assert 0 < second.nbytes < first.nbytes
    sync.push(step=1)
    assert sync.holds(1) and not sync.holds(0)
    engine.sleep()  # the engine freed what was pushed: the owner sees it, and the next push brings the base again
    assert not sync.holds(1)
    engine.calls.clear()
    assert sync.push(step=1).nbytes == first.nbytes
    assert [c[0] for c in engine.calls] == ["weights", "adapter"] and sync.holds(1)
    sync.forget()  # a restored checkpoint: push before the next rollout
    assert not sync.holds(1)
    assert vars(engine).keys() == {"calls", "_has_weights"}  # nothing written on the engine from outside


def test_weight_samples_load_aside_as_adapters_named_by_sample(lora_policy):
    engine = ServerLike()
    sync = WeightSync(engine, lora_policy)
    assert sync.can_stack_sources()
    sync.push(step=3)
    adapters = [p for p in lora_policy.parameters() if p.requires_grad]
    stacks = {p: torch.stack([p.detach(), p.detach() + 1]) for p in adapters}  # [2, *shape]
    params = sync.load_samples(stacks, [SamplingParams(seed=0), SamplingParams(seed=1)], step=3)
    names = [adapter_name(3, sample=0), adapter_name(3, sample=1)]
    assert [p.adapter for p in params] == names == sync.sample_adapters
    assert engine.calls[-2:] == [("adapter", n, False) for n in names]  # aside: the mean stays the default
    assert sync.adapter == adapter_name(3, push=0) and sync.holds(3)


def test_an_hf_copy_engine_is_pushed_to_and_keeps_no_bookkeeping(lora_policy, tiny_path):
    tokenizer = load_policy(tiny_path)[1]
    engine = HFEngine(lora_policy, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy",
                      lora_sync="merged")
    before = set(vars(engine))
    sync = WeightSync(engine, lora_policy)
    full = sync.push(step=0).nbytes
    assert 0 < sync.push(step=1).nbytes < full  # then only the adapted layers, merged
    assert set(vars(engine)) == before  # the pushes wrote no state on the engine
