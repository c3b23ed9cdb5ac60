"""The asynchronous pipeline's staleness rule and metrics, on hand-set versions (no timing involved): a batch exactly
S versions old trains, one S + 1 old is dropped (with `drop`) and generated again at the current version, and the
pipeline refuses to hand out a batch past the bound; the `async/*` metrics counted by hand; the seed key of each
batch; the partial-rollout engine's pushes; the producer's idle time; what a checkpoint keeps."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from lit_rlvr.config.settings import RolloutConfig
from lit_rlvr.rollout.source import async_refusals
import torch

from lit_rlvr.rollout.batch import RolloutPlan
from lit_rlvr.rollout.pipeline import Producer, RolloutPipeline, completion_versions, held_bytes


class Driver:
    """Generates at once; records (batch's first answer, seed key, the plan's source weights when generated)."""

    def __init__(self):
        self.weight_sync = SimpleNamespace(version=0)
        self.calls = []

    def rollout(self, plan, *, step, seed_key, group=None, push_policy=True):
        assert push_policy is False  # the producer never pushes
        self.calls.append((plan.answers[0], seed_key, step))
        return SimpleNamespace(plan=plan)


def gated_driver(gate: threading.Event, started: threading.Event) -> type:
    """A `Driver` whose generation sets `started`, then waits for `gate`: a plan under way as long as a test needs."""

    class Gated(Driver):
        def rollout(self, plan, **kwargs):
            started.set()
            assert gate.wait(timeout=30)
            return super().rollout(plan, **kwargs)

    return Gated


def plan_of(batch, version=0, source_weights=None):
    return RolloutPlan(batch["prompt"], batch["answer"], [[1]] * len(batch["prompt"]), [2] * len(batch["prompt"]),
                       version=version, source_weights=source_weights)


def batch(index: int, prompts: int = 2) -> dict:
    return {"prompt": [f"p{index}{c}" for c in "abc"[:prompts]], "answer": [index] * prompts}


def settle(pipeline):
    for item in pipeline.in_flight:
        assert item.done.wait(timeout=30)


def push(pipeline, version):
    with pipeline.engine_access(), pipeline.pushing(version):
        pass


def test_a_batch_s_versions_old_trains_and_one_older_is_dropped_and_generated_again():
    driver = Driver()
    pipeline = RolloutPipeline(driver, max_staleness=1, lead=2, drop=True, seed=5)
    try:
        assert pipeline.exchange(batch(0), plan_of, version=0, step=0) is None
        assert pipeline.exchange(batch(1, prompts=3), plan_of, version=0, step=0) is None
        settle(pipeline)  # batches 0 and 1: generated at version 0
        push(pipeline, 1)
        item = pipeline.exchange(batch(2), plan_of, version=1, step=1)
        assert (item.index, item.version) == (0, 0) and pipeline.dropped_groups == 0  # 1 old: S, trains
        settle(pipeline)  # batch 2: version 1
        push(pipeline, 2)
        item = pipeline.exchange(batch(3), plan_of, version=2, step=2)
        # batch 1 is 2 versions old: evicted whole (its 3 prompts) and generated again with version 2
        assert (item.index, item.version) == (1, 2) and pipeline.dropped_groups == 3
        assert [c[0] for c in driver.calls].count(1) == 2
        metrics = pipeline.metrics(SimpleNamespace(policy_version=torch.full((6,), 2), token_version=None,
                                                   num_samples=6, response_mask=None), version=2)
        assert float(metrics["async/dropped_groups"]) == 3.0 and float(metrics["async/staleness_max"]) == 0.0
        assert float(metrics["async/in_flight"]) == 2.0
        settle(pipeline)
        item = pipeline.exchange(batch(4), plan_of, version=2, step=3)
        assert (item.index, item.version) == (2, 1) and pipeline.dropped_groups == 0  # reset each step
    finally:
        pipeline.close()


def test_without_drop_a_batch_past_the_bound_is_refused():
    driver = Driver()
    pipeline = RolloutPipeline(driver, max_staleness=1, lead=0, drop=False, seed=0)
    try:
        item = pipeline.exchange(batch(0), plan_of, version=1, step=0)  # generated at 0, trains 1: S
        assert item.version == 0
        with pytest.raises(RuntimeError, match=r"batch 1 of version 0 would train the update of version 2, past "
                                               r"rollout.max_staleness=1"):
            pipeline.exchange(batch(1), plan_of, version=2, step=1)
    finally:
        pipeline.close()


def test_the_seed_key_is_the_trainers_step_in_lockstep_and_the_batchs_position_ahead():
    driver = Driver()
    lockstep = RolloutPipeline(driver, max_staleness=0, lead=0, drop=False, seed=9, next_index=4)
    try:
        lockstep.exchange(batch(0), plan_of, version=0, step=7)
    finally:
        lockstep.close()
    ahead = RolloutPipeline(driver, max_staleness=1, lead=1, drop=False, seed=9, next_index=4)
    try:
        ahead.exchange(batch(1), plan_of, version=0, step=7)
        ahead.exchange(batch(2), plan_of, version=0, step=8)
        settle(ahead)
        assert ahead.state() == {"next_index": 6, "in_flight": [(5, batch(2))]}
    finally:
        ahead.close()
    assert [key for _, key, _ in driver.calls] == [(9, 7), (9, 4), (9, 5)]


def test_the_state_keeps_pending_batches_first():
    pipeline = RolloutPipeline(Driver(), max_staleness=1, lead=1, drop=False, seed=0, next_index=3,
                               pending=((1, batch(1)), (2, batch(2))))
    try:
        assert pipeline.state() == {"next_index": 3, "in_flight": [(1, batch(1)), (2, batch(2))]}
        item = pipeline.exchange(batch(3), plan_of, version=0, step=0)
        assert item.index == 1 and pipeline.state()["in_flight"] == [(2, batch(2)), (3, batch(3))]
    finally:
        pipeline.close()


def test_staleness_metrics_are_counted_per_completion():
    pipeline = RolloutPipeline(Driver(), max_staleness=3, lead=0, drop=False, seed=0)
    try:
        rollouts = SimpleNamespace(policy_version=torch.tensor([3, 1, 2, 2]), token_version=None, num_samples=4)
        metrics = pipeline.metrics(rollouts, version=4)
        assert float(metrics["async/staleness_mean"]) == 2.0 and float(metrics["async/staleness_max"]) == 3.0
        assert float(metrics["async/partial_frac"]) == 0.0 and float(metrics["async/in_flight"]) == 0.0
        mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
        tokens = torch.tensor([[2, 3, 9], [1, 1, 1], [2, 0, 0], [5, 5, 5]])
        spanning = SimpleNamespace(policy_version=torch.tensor([2, 1, 2, 9]), token_version=tokens,
                                   response_mask=mask, num_samples=4)
        assert float(pipeline.metrics(spanning, version=4)["async/partial_frac"]) == 0.25  # row 0 spans 2 and 3
    finally:
        pipeline.close()


def test_completion_versions_take_the_oldest_sampled_token():
    tokens = torch.tensor([[4, 3, 1], [2, 2, 2], [7, 7, 7], [5, 6, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    oldest, spans = completion_versions(tokens, mask, fallback=8)
    assert oldest.tolist() == [3, 2, 8, 0]  # padding ignored; an empty completion gets the fallback
    assert spans.tolist() == [True, False, False, True]


def test_shares_of_the_step():
    pipeline = RolloutPipeline(Driver(), max_staleness=0, lead=0, drop=False, seed=0)
    try:
        time.sleep(0.05)
        shares = pipeline.shares(SimpleNamespace(times={"wait_s": 0.5}), 2.0)
        assert float(shares["async/trainer_wait_frac"]) == 0.25
        assert 0.0 < float(shares["async/engine_idle_frac"]) <= 1.0
        time.sleep(0.05)
        assert float(pipeline.shares(SimpleNamespace(times={}), 0.0)["async/engine_idle_frac"]) == 1.0  # capped
        assert float(pipeline.shares(SimpleNamespace(times={}), 10.0)["async/trainer_wait_frac"]) == 0.0
    finally:
        pipeline.close()


def test_idle_time_is_counted_while_the_engine_waits_and_reset_when_taken():
    gate, started = threading.Event(), threading.Event()
    Slow = gated_driver(gate, started)
    built = time.perf_counter()
    producer = Producer(Slow(), seed=0, version=0)
    try:
        time.sleep(0.1)
        first = producer.take_idle()
        assert 0.09 <= first <= time.perf_counter() - built  # idle since it started, and no longer than that
        item = SimpleNamespace(plan=plan_of(batch(0)), index=0, done=threading.Event(), result=None, error=None)
        producer.submit(item)
        assert started.wait(timeout=30)
        producer.take_idle()
        time.sleep(0.5)
        busy = producer.take_idle()
        assert 0.0 <= busy < 0.4  # generating: not idle
        gate.set()
        assert item.done.wait(timeout=30)
        time.sleep(0.1)
        assert producer.take_idle() >= 0.09
    finally:
        gate.set()
        producer.close()


def test_a_plan_with_its_own_weights_has_their_version_and_frees_them():
    driver = Driver()
    pipeline = RolloutPipeline(driver, max_staleness=3, lead=0, drop=False, seed=0, version=2)
    try:
        item = pipeline.exchange(batch(0), lambda b: plan_of(b, version=1, source_weights=[torch.zeros(4)]),
                                 version=2, step=0)
        assert item.version == 1 and item.plan.source_weights is None  # the 3PO snapshot's version; freed
        item = pipeline.exchange(batch(1), lambda b: plan_of(b, version=0), version=2, step=1)
        assert item.version == 2  # the mean weights: the engine's version
    finally:
        pipeline.close()


def test_the_producer_generates_in_order_and_close_drops_what_is_queued():
    gate, started = threading.Event(), threading.Event()

    class Gated(Driver):
        def rollout(self, plan, **kwargs):
            started.set()
            assert gate.wait(timeout=30)
            return super().rollout(plan, **kwargs)

    def item(i):
        return SimpleNamespace(plan=plan_of(batch(i)), index=i, done=threading.Event(), result=None, error=None)

    driver = Gated()
    producer = Producer(driver, seed=1, version=0)
    items = [item(i) for i in range(3)]
    producer.submit(items[0])
    assert started.wait(timeout=30)  # batch 0 under way
    producer.submit(items[1])
    producer.submit(items[2], first=True)  # ahead of batch 1
    gate.set()
    assert all(i.done.wait(timeout=30) for i in items)
    assert [c[0] for c in driver.calls] == [0, 2, 1]
    assert [c[1] for c in driver.calls] == [(1, 0), (1, 2), (1, 1)]
    gate.clear()
    started.clear()
    later = [item(5), item(6)]
    producer.submit(later[0])
    assert started.wait(timeout=30)
    producer.submit(later[1])
    threading.Timer(0.1, gate.set).start()
    producer.close()
    assert not producer._thread.is_alive()
    assert [c[0] for c in driver.calls] == [0, 2, 1, 5]  # 6 was queued behind the plan under way: dropped


def test_a_producer_that_does_not_stop_in_time_is_left_behind(caplog):
    gate = threading.Event()

    class Stuck(Driver):
        def rollout(self, plan, **kwargs):
            gate.wait(timeout=30)
            return super().rollout(plan, **kwargs)

    producer = Producer(Stuck(), seed=0, version=0)
    item = SimpleNamespace(plan=plan_of(batch(0)), index=0, done=threading.Event(), result=None, error=None)
    producer.submit(item)
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING):
        producer.close(timeout_s=0.1)
    gate.set()
    assert "did not end within 0 s" in caplog.text


class SwappingEngine:
    swaps_in_flight = True

    def __init__(self):
        self.pushes = []

    @contextmanager
    def push_in_flight(self, tag, *, recompute_kv=False):
        self.pushes.append((tag, recompute_kv))
        yield


def test_partial_rollouts_push_in_flight_and_tag_the_engine_at_start():
    engine = SwappingEngine()
    driver = Driver()
    driver.engine = engine
    pipeline = RolloutPipeline(driver, max_staleness=1, lead=1, drop=False, seed=0, version=3, partial=True,
                               recompute_kv=True)
    try:
        assert engine.pushes == [(3, False)]  # the weights it holds are tagged with the version
        with pipeline.pushing(4):
            assert pipeline.producer.version == 3  # set once the push is made
        assert engine.pushes[-1] == (4, True) and pipeline.producer.version == 4
    finally:
        pipeline.close()
    plain = Driver()
    plain.engine = engine
    other = RolloutPipeline(plain, max_staleness=1, lead=1, drop=False, seed=0)
    try:
        with other.pushing(1):
            pass
        assert engine.pushes[-1] == (4, True) and other.producer.version == 1  # no in-flight push
    finally:
        other.close()


def test_an_engine_that_cannot_swap_in_flight_is_refused():
    """The refusal lives with the rollout source's (`async_refusals`), asked once the engine is built."""
    rollout = RolloutConfig(mode="async", max_staleness=1, partial_rollout=True)
    cannot, can = SimpleNamespace(swaps_in_flight=False), SimpleNamespace(swaps_in_flight=True)
    assert async_refusals(rollout, engine=cannot) == [
        "rollout.partial_rollout=true: SimpleNamespace takes no push while it generates; "
        "set rollout.partial_rollout=false"]
    assert async_refusals(rollout, engine=can) == []
    assert async_refusals(RolloutConfig(mode="async", max_staleness=1), engine=cannot) == []


def test_held_bytes_walks_nested_values_once():
    shared = torch.zeros(16)  # 64 bytes
    cyclic: list = [shared]
    cyclic.append(cyclic)
    value = {"a": (shared, torch.zeros(2, dtype=torch.float64)), "b": [cyclic], "c": SimpleNamespace(x=torch.ones(9))}
    assert held_bytes(value) == 64 + 16  # the namespace is not walked: not a dataclass, mapping or sequence
    assert held_bytes(None) == 0 and held_bytes(torch.ones(3)) == 12


def test_the_producer_starts_no_plan_while_the_trainer_holds_the_engine():
    driver = Driver()
    producer = Producer(driver, seed=0, version=0)
    item = SimpleNamespace(plan=plan_of(batch(0)), index=0, done=threading.Event(), result=None, error=None)
    try:
        with producer.engine_access():
            with producer.engine_access():  # nested holds: released by the outer one only
                producer.submit(item)
            assert not item.done.wait(timeout=0.2) and driver.calls == []
        assert item.done.wait(timeout=30) and len(driver.calls) == 1
    finally:
        producer.close()


def test_the_wait_for_a_batch_is_timed_per_step():
    gate = threading.Event()

    class Gated(Driver):
        def rollout(self, plan, **kwargs):
            assert gate.wait(timeout=30)
            return super().rollout(plan, **kwargs)

    pipeline = RolloutPipeline(Gated(), max_staleness=0, lead=0, drop=False, seed=0)
    try:
        threading.Timer(0.6, gate.set).start()
        pipeline.exchange(batch(0), plan_of, version=0, step=0)
        assert 0.55 <= pipeline.wait_s < 30  # waited for the producer
        pipeline.exchange(batch(1), plan_of, version=0, step=1)
        assert 0.0 <= pipeline.wait_s < 0.5  # the next step's own wait: not added to the last
    finally:
        gate.set()
        pipeline.close()


def test_a_step_of_no_duration_has_a_bounded_share():
    pipeline = RolloutPipeline(Driver(), max_staleness=0, lead=0, drop=False, seed=0)
    try:
        shares = pipeline.shares(SimpleNamespace(times={"wait_s": 1e-9}), 0.0)
        assert float(shares["async/trainer_wait_frac"]) == pytest.approx(1.0)  # over at least 1 ns
    finally:
        pipeline.close()


def test_padding_never_makes_a_completion_span_versions():
    tokens = torch.tensor([[0, 0, 9], [3, 3, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    oldest, spans = completion_versions(tokens, mask, fallback=-1)
    assert oldest.tolist() == [0, 3] and spans.tolist() == [False, False]


def test_the_idle_time_before_a_plan_counts_once_the_plan_starts():
    """The wait for work that ends when a plan starts is idle time: `take_idle` during the plan returns it (no more
    than the time since the last call), then nothing while the plan runs."""
    gate, started = threading.Event(), threading.Event()
    Slow = gated_driver(gate, started)
    producer = Producer(Slow(), seed=0, version=0)
    try:
        producer.take_idle()
        since = time.perf_counter()
        time.sleep(0.3)
        item = SimpleNamespace(plan=plan_of(batch(0)), index=0, done=threading.Event(), result=None, error=None)
        producer.submit(item)
        assert started.wait(timeout=30)
        idle = producer.take_idle()
        assert 0.29 <= idle <= time.perf_counter() - since
        producer_threads = [t for t in threading.enumerate() if t.name == "lit-rlvr-producer"]
        assert producer_threads and all(t.daemon for t in producer_threads)  # a hung engine call never holds the exit
    finally:
        gate.set()
        producer.close()


def test_partial_pushes_keep_the_kv_cache_unless_asked():
    """`recompute_kv` is off unless set (`rollout.kv_at_swap=keep`, the setting's default)."""
    calls = []

    class Engine:
        @contextmanager
        def push_in_flight(self, version, recompute_kv=None):
            calls.append((version, recompute_kv))
            yield

    driver = Driver()
    driver.engine = Engine()
    pipeline = RolloutPipeline(driver, max_staleness=1, lead=0, drop=False, seed=0, partial=True)
    try:
        with pipeline.pushing(1):
            pass
    finally:
        pipeline.close()
    assert calls[-1] == (1, False)
