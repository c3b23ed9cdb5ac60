"""Which path a weight push takes, seen from a recording engine: nothing to an engine that shares the trainer's
weights; every parameter, cast and bucketed, to one that keeps its own copy; a LoRA policy's base once and then its
adapter (or merged weights, the adapted layers only after the first push); the post-push check's cadence; and when
the engine already holds the weights a rollout needs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_rlvr.config.settings import LoraOptions
from lit_rlvr.models.lora import apply_lora
from lit_rlvr.models.tiny import build_tiny
from lit_rlvr.rollout import weight_sync as weight_sync_module
from lit_rlvr.rollout.engine import RolloutEngine, SamplingParams
from lit_rlvr.rollout.lora import SyncCheck, adapter_name
from lit_rlvr.rollout.weight_sync import WeightSync
from lit_rlvr.rollout.weights import buckets, push_weights


class Recorder(RolloutEngine):
    """Records loads (names, dtypes, bytes per call), adapters, wakes and the end of each update."""

    def __init__(self, **capabilities):
        for key, value in capabilities.items():
            setattr(self, key, value)
        self.loads: list[list[tuple[str, torch.dtype, int]]] = []
        self.adapters: list[tuple[str, dict, bool]] = []
        self.events: list[str] = []

    def load_weights(self, named_tensors):
        self.loads.append([(n, t.dtype, t.numel() * t.element_size()) for n, t in named_tensors])
        self.events.append("load")

    def end_weight_update(self):
        self.events.append("end")

    def load_adapter(self, name, tensors, config, activate=True):
        self.adapters.append((name, tensors, activate))
        self.events.append("adapter")

    def wake(self):
        self.events.append("wake")

    def loaded_names(self):
        return [n for call in self.loads for n, _, _ in call]


@pytest.fixture(scope="module")
def plain():
    return build_tiny(0)[0]


@pytest.fixture(scope="module")
def lora():
    return apply_lora(build_tiny(0)[0], LoraOptions(rank=2), seed=0)


def param_bytes(model, element_size=None):
    return sum(p.numel() * (element_size or p.element_size()) for p in model.parameters())


def test_an_engine_that_shares_the_weights_gets_nothing(plain):
    engine = Recorder(shares_weights=True)
    sync = WeightSync(engine, plain)
    result = sync.push(step=3)
    assert result.nbytes == 0 and engine.loads == [] and engine.events == ["wake"]
    assert sync.version == 3 and sync.holds(3) and result.metrics == {}
    with pytest.raises(RuntimeError, match="shares the trainer's weights"):
        sync.push_named([("x", torch.zeros(1))], step=4)


def test_a_copy_engine_gets_every_parameter_cast_and_bucketed(plain):
    engine = Recorder(weight_dtype=torch.bfloat16, bucket_bytes=4096)
    sync = WeightSync(engine, plain)
    result = sync.push(step=1)
    assert engine.loaded_names() == [n for n, _ in plain.named_parameters()]
    assert {d for call in engine.loads for _, d, _ in call} == {torch.bfloat16}
    assert result.nbytes == param_bytes(plain, 2) == sum(b for call in engine.loads for _, _, b in call)
    assert all(sum(b for _, _, b in call) <= 4096 or len(call) == 1 for call in engine.loads)
    assert len(engine.loads) > 1 and engine.events[0] == "wake" and engine.events[-1] == "end"
    assert engine.events.count("end") == 1


def test_buckets_fill_up_to_the_cap_and_a_large_tensor_travels_alone():
    sizes = [3, 3, 2, 10, 1, 1]  # float32: 4 bytes per element
    named = [(str(i), torch.zeros(n)) for i, n in enumerate(sizes)]
    grouped = [[name for name, _ in bucket] for bucket in buckets(iter(named), 32)]
    assert grouped == [["0", "1", "2"], ["3"], ["4", "5"]]  # 32 bytes fit exactly; 40 alone
    assert [[n for n, _ in b] for b in buckets(iter(named), 31)] == [["0", "1"], ["2"], ["3"], ["4", "5"]]
    assert list(buckets(iter([]), 8)) == []


def test_a_bucket_starts_empty_after_it_is_sent():
    named = [(str(i), torch.zeros(4)) for i in range(6)]  # 16 bytes each: two fill a 32-byte bucket exactly
    assert [[n for n, _ in b] for b in buckets(iter(named), 32)] == [["0", "1"], ["2", "3"], ["4", "5"]]


def test_push_weights_default_bucket_is_256_mib():
    """The default cap (docs/results/weight_sync.md: 256 MiB buckets): exactly 256 MiB of weights is one load,
    one float32 element more is two. Meta tensors: sizes without memory."""
    mib = 1 << 20

    def model(extra):
        layer = nn.Module()
        layer.big = nn.Parameter(torch.empty(64 * mib - 1, device="meta"))  # 256 MiB - 4 bytes
        layer.small = nn.Parameter(torch.empty(1 + extra, device="meta"))
        return layer

    exact, over = Recorder(), Recorder()
    assert push_weights(exact, model(0)) == 256 * mib
    assert push_weights(over, model(1)) == 256 * mib + 4
    assert [len(call) for call in exact.loads] == [2]
    assert [len(call) for call in over.loads] == [1, 1]


def test_push_weights_counts_every_byte(plain):
    engine = Recorder()
    assert push_weights(engine, plain, bucket_bytes=1 << 20, dtype=torch.float16) == param_bytes(plain, 2)
    assert engine.events[-1] == "end" and engine.events.count("end") == 1


def test_what_the_engine_holds(plain):
    engine = Recorder()
    sync = WeightSync(engine, plain)
    assert not sync.holds(0)  # nothing pushed yet
    sync.push(step=2)
    assert sync.holds(2) and not sync.holds(1) and not sync.holds(3)
    sync.forget()  # a checkpoint restored: push again
    assert not sync.holds(2)
    sync.push(step=2, holds_mean=False)  # a 3PO weight sample
    assert not sync.holds(2)
    sync.push(step=2)
    engine.holds_weights = False  # a sleep freed them
    assert not sync.holds(2)


def test_push_named_sends_the_given_tensors_cast_for_a_plain_policy(plain):
    engine = Recorder(weight_dtype=torch.float16)
    sync = WeightSync(engine, plain)
    seconds = sync.push_named([("a", torch.ones(3)), ("b", torch.ones(2, 2))], step=5)
    assert engine.loads == [[("a", torch.float16, 6), ("b", torch.float16, 8)]] and seconds >= 0
    assert engine.events == ["wake", "load", "end"]
    assert sync.version == 5 and not sync.holds(5)  # not the mean weights
    uncast = Recorder()
    WeightSync(uncast, plain).push_named([("a", torch.ones(3))], step=0)
    assert uncast.loads == [[("a", torch.float32, 12)]]


def lora_names(policy):
    return {n for n, p in policy.named_parameters() if p.requires_grad}


def test_a_lora_policy_sends_the_base_once_then_adapters_named_per_push(lora):
    engine = Recorder(serves_lora=True, lora_sync="adapter", weight_dtype=torch.bfloat16)
    sync = WeightSync(engine, lora)
    first = sync.push(step=0)
    base = engine.loaded_names()
    assert base and not any(".lora_" in n for n in base)  # the frozen base, by HF name
    adapter_bytes = sum(p.numel() * 2 for p in lora.parameters() if p.requires_grad)
    assert first.nbytes == sum(b for call in engine.loads for _, _, b in call) + adapter_bytes
    names = [a[0] for a in engine.adapters]
    assert names == [adapter_name(0, push=0)] and engine.adapters[0][2] is True and sync.adapter == names[0]
    assert {t.dtype for t in engine.adapters[0][1].values()} == {torch.bfloat16}
    loads = len(engine.loads)
    second = sync.push(step=0)  # the same version again: a new name, no base
    third = sync.push(step=1)  # a new version: its count starts again
    assert len(engine.loads) == loads and second.nbytes == third.nbytes == adapter_bytes
    assert [a[0] for a in engine.adapters] == [adapter_name(0, push=0), adapter_name(0, push=1),
                                               adapter_name(1, push=0)]
    engine.holds_weights = False  # a sleep freed the base: sent again
    sync.push(step=2)
    assert len(engine.loads) > loads


def test_an_adapter_engine_that_starts_with_its_base_gets_adapters_only(lora):
    engine = Recorder(serves_lora=True, lora_sync="adapter", adapter_base_by_name=False)
    result = WeightSync(engine, lora).push(step=0)
    assert engine.loads == [] and len(engine.adapters) == 1
    assert result.nbytes == sum(p.numel() * 4 for p in lora.parameters() if p.requires_grad)


@pytest.mark.parametrize("capabilities", [dict(serves_lora=True, lora_sync="merged"),
                                          dict(serves_lora=False, lora_sync="adapter")])
def test_merged_pushes_send_everything_first_then_the_adapted_layers(lora, capabilities):
    engine = Recorder(**capabilities)
    sync = WeightSync(engine, lora)
    sync.push(step=0)
    first = engine.loaded_names()
    engine.loads.clear()
    sync.push(step=1)
    later = engine.loaded_names()
    assert engine.adapters == [] and not any(".lora_" in n for n in first + later)
    assert set(later) < set(first) and later  # the adapted layers only
    engine.loads.clear()
    engine.holds_weights = False
    sync.push(step=2)
    assert engine.loaded_names() == first


def test_push_named_of_a_lora_policy_sends_the_given_adapter_values(lora):
    engine = Recorder(serves_lora=True, lora_sync="adapter", adapter_base_by_name=False)
    sync = WeightSync(engine, lora)
    given = {n: torch.full_like(p, 0.5) for n, p in lora.named_parameters() if p.requires_grad}
    sync.push_named(given.items(), step=4)
    (name, tensors, _), = engine.adapters
    assert name == adapter_name(4, push=0) and all(float(t.flatten()[0]) == 0.5 for t in tensors.values())
    assert len(tensors) == len(given) and not sync.holds(4)


def test_weight_samples_load_aside_one_adapter_each(lora):
    engine = Recorder(serves_lora=True, lora_sync="adapter", weight_dtype=torch.float16)
    sync = WeightSync(engine, lora)
    trained = [p for p in lora.parameters() if p.requires_grad]
    stacks = {p: torch.stack([torch.full_like(p, float(j)) for j in range(3)]) for p in trained}
    params = sync.load_samples(stacks, [SamplingParams(), SamplingParams(), SamplingParams()], step=7)
    assert [p.adapter for p in params] == [adapter_name(7, j) for j in range(3)] == sync.sample_adapters
    for j, (name, tensors, activate) in enumerate(engine.adapters):
        assert activate is False and {float(t.flatten()[0]) for t in tensors.values()} == {float(j)}
        assert {t.dtype for t in tensors.values()} == {torch.float16}


def test_stacked_sources(plain, lora):
    stacking = dict(can_generate_stacked=True)
    assert WeightSync(Recorder(shares_weights=True, **stacking), plain).can_stack_sources()
    assert not WeightSync(Recorder(shares_weights=True), plain).can_stack_sources()
    assert not WeightSync(Recorder(**stacking), plain).can_stack_sources()  # a copy of the full weights
    adapters = dict(serves_lora=True, lora_sync="adapter", serves_many_adapters=True, **stacking)
    assert WeightSync(Recorder(**adapters), lora).can_stack_sources()
    assert not WeightSync(Recorder(**adapters), plain).can_stack_sources()  # no adapters to stack
    for missing in ("serves_lora", "serves_many_adapters"):
        assert not WeightSync(Recorder(**{**adapters, missing: False}), lora).can_stack_sources()
    assert not WeightSync(Recorder(**{**adapters, "lora_sync": "merged"}), lora).can_stack_sources()


def test_the_post_push_check_runs_every_kth_push_and_counts_named_pushes(plain, monkeypatch):
    checked = []
    monkeypatch.setattr(weight_sync_module, "check_engine_sync",
                        lambda engine, policy, probe, *, check, version: checked.append(version) or torch.tensor(0.0))
    sync = WeightSync(Recorder(), plain, SyncCheck(every=2), probe=[1, 2])
    due = []
    for step in range(5):
        due.append(sync.check_due())
        metrics = sync.push(step=step)
        assert ("engine/sync_logp_diff" in metrics.metrics) == (step in (0, 2, 4))
    assert checked == [0, 2, 4] and due == [True, False, True, False, True]
    sync.push_named([("a", torch.ones(1))], step=5)  # the 6th push: counts toward the cadence, is not checked
    assert sync.check_due() and checked == [0, 2, 4]
    sync.push(step=6)  # the 7th: checked
    assert checked == [0, 2, 4, 6] and not sync.check_due()


@pytest.mark.parametrize("check, shares", [(None, False), (SyncCheck(every=0), False), (SyncCheck(every=1), True)])
def test_no_post_push_check(plain, monkeypatch, check, shares):
    monkeypatch.setattr(weight_sync_module, "check_engine_sync", lambda *a, **k: pytest.fail("checked"))
    sync = WeightSync(Recorder(shares_weights=shares), plain, check)
    assert not sync.check_due()
    assert sync.push(step=0).metrics == {}
    sync.push_named([("a", torch.ones(1))], step=1) if not shares else None
    assert not sync.check_due()


def test_given_adapter_values_are_cast_to_the_engines_dtype(lora):
    engine = Recorder(serves_lora=True, lora_sync="adapter", adapter_base_by_name=False, weight_dtype=torch.float16)
    given = {n: torch.full_like(p, 0.5) for n, p in lora.named_parameters() if p.requires_grad}
    WeightSync(engine, lora).push_named(given.items(), step=1)
    (_, tensors, _), = engine.adapters
    assert {t.dtype for t in tensors.values()} == {torch.float16}


def test_a_sharded_policy_does_not_stack_adapters(lora):
    import copy

    sharded = copy.deepcopy(lora)
    next(p for p in sharded.parameters() if p.requires_grad).full_tensor = lambda: None  # as a DTensor shard
    engine = Recorder(serves_lora=True, lora_sync="adapter", serves_many_adapters=True, can_generate_stacked=True)
    assert WeightSync(engine, lora).can_stack_sources()
    assert not WeightSync(engine, sharded).can_stack_sources()


def test_a_named_push_moves_the_check_cadence(plain, monkeypatch):
    checked = []
    monkeypatch.setattr(weight_sync_module, "check_engine_sync",
                        lambda engine, policy, probe, *, check, version: checked.append(version) or torch.tensor(0.0))
    sync = WeightSync(Recorder(), plain, SyncCheck(every=3))
    sync.push(step=0)  # 1st push: checked
    sync.push_named([("a", torch.ones(1))], step=1)  # 2nd
    sync.push(step=2)  # 3rd
    sync.push(step=3)  # 4th: checked
    assert checked == [0, 3]


def test_a_check_every_push(plain, monkeypatch):
    checked = []
    monkeypatch.setattr(weight_sync_module, "check_engine_sync",
                        lambda engine, policy, probe, *, check, version: checked.append(version) or torch.tensor(0.0))
    sync = WeightSync(Recorder(), plain, SyncCheck(every=1))
    for step in range(3):
        assert sync.check_due()
        sync.push(step=step)
    assert checked == [0, 1, 2]
