"""`RolloutPipeline` (lit_rlvr/rollout/pipeline.py) against the invariants the asynchronous peers keep (AReaL's
capacity, verl's drop-and-refill, TRL's staleness bound): no more than `lead` batches ever in flight ahead of the one
trained; nothing older than S reaches an update; a dropped batch is generated again exactly once; a resumed run
generates its in-flight batches again, first, none twice and none skipped; S = 0 is the synchronous order.

The driver here is a scripted one (a thread-safe stand-in whose generation takes a random short time), so that the
interleavings vary from run to run; train.py runs of the real producer are in tests/test_async_runs.py."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from lit_rlvr.config.errors import ConfigError, StopRequested
from lit_rlvr.config.settings import RolloutConfig
from lit_rlvr.rollout.batch import RolloutPlan
from lit_rlvr.rollout.pipeline import RolloutPipeline, held_bytes
from lit_rlvr.run.stop import STOP


class ScriptedDriver:
    """Records each generation: (batch index, the engine's version, the seed key); sleeps 0–`max_s` seconds."""

    def __init__(self, seed: int, max_s: float = 0.004):
        self.weight_sync = SimpleNamespace(version=0)
        self.calls: list[tuple[int, int, tuple]] = []
        self.busy = threading.Lock()
        self.random, self.max_s = random.Random(seed), max_s

    def rollout(self, plan: RolloutPlan, *, step: int, seed_key: tuple, group=None, push_policy=True):
        assert self.busy.acquire(blocking=False), "two plans generated at once"
        try:
            time.sleep(self.random.random() * self.max_s)
            self.calls.append((plan.answers[0], step, seed_key))
            return SimpleNamespace(plan=plan)
        finally:
            self.busy.release()


def plan_of(batch):
    return RolloutPlan(batch["prompt"], batch["answer"], [[1]] * len(batch["prompt"]), [2] * len(batch["prompt"]))


def batch(index: int) -> dict:
    return {"prompt": [f"p{index}a", f"p{index}b"], "answer": [index, index]}


def train(pipeline: RolloutPipeline, driver: ScriptedDriver, indices, version: int, update_s: float = 0.003):
    """The trainer's loop: each step submits a batch, updates on what it got back and pushes (version + 1)."""
    trained = []
    for index in indices:
        item = pipeline.exchange(batch(index), plan_of, version=version, step=version)
        assert len(pipeline.in_flight) <= pipeline.lead  # the capacity
        if item is None:
            continue
        assert version - item.version <= pipeline.max_staleness  # nothing past the bound trains
        assert item.result.plan.prompts == batch(item.index)["prompt"]
        trained.append((item.index, version - item.version))
        time.sleep(update_s)
        with pipeline.engine_access(), pipeline.pushing(version + 1):
            assert not driver.busy.locked()  # a push never meets a generation under way
            version += 1
            driver.weight_sync.version = version
    return trained, version


@pytest.mark.parametrize("staleness", [0, 1, 3])
@pytest.mark.parametrize("strategy", ["wait", "drop"])
def test_capacity_bound_and_order(staleness, strategy):
    # RolloutConfig.lead; the setting refuses drop at S = 0 (every batch generated twice), the pipeline bounds it still
    lead = staleness + (strategy == "drop")
    for seed in range(3):  # other interleavings
        driver = ScriptedDriver(seed)
        pipeline = RolloutPipeline(driver, max_staleness=staleness, lead=lead, drop=strategy == "drop",
                                   seed=7)
        try:
            trained, _ = train(pipeline, driver, range(12), version=0)
            for item in list(pipeline.in_flight):  # the batches still queued get generated (close drops them)
                assert item.done.wait(timeout=60)
        finally:
            pipeline.close()
        assert [i for i, _ in trained] == list(range(12 - lead))  # in order, each once
        assert max(s for _, s in trained) <= staleness
        generated = [i for i, _, _ in driver.calls]
        dropped = len(generated) - len(set(generated))
        assert sorted(set(generated)) == list(range(12))  # the queued ones too
        assert all(generated.count(i) <= 2 for i in generated)  # a dropped batch is generated again once
        assert all(key == (7, i) for i, _, key in driver.calls)  # each batch keeps its seed key
        if strategy == "wait":
            assert dropped == 0
        if staleness == 0 and strategy == "wait":  # the synchronous order: generate b, train b, push
            assert [v for _, v, _ in driver.calls] == list(range(12))


def test_drop_counts_groups_and_trains_the_fresh_copy():
    driver = ScriptedDriver(0, max_s=0.0)  # generation faster than the update: every batch is one version old
    pipeline = RolloutPipeline(driver, max_staleness=0, lead=1, drop=True, seed=0)
    try:
        trained, _ = train(pipeline, driver, range(5), version=0, update_s=0.01)
        dropped = pipeline.dropped_groups
    finally:
        pipeline.close()
    assert [s for _, s in trained] == [0, 0, 0, 0]
    assert dropped == 2  # the last step's batch (two prompts) was evicted and generated again
    generated = [i for i, _, _ in driver.calls]
    assert generated.count(0) == 1 and all(generated.count(i) == 2 for i in (1, 2, 3))


def test_resume_generates_the_batches_in_flight_again_first():
    """Stop after 6 batches with S = 2, resume from the saved state: every batch trains exactly once, in order."""
    driver = ScriptedDriver(1)
    first = RolloutPipeline(driver, max_staleness=2, lead=2, drop=False, seed=3)
    try:
        trained, version = train(first, driver, range(6), version=0)
        state = first.state()
    finally:
        first.close()
    assert [i for i, _ in state["in_flight"]] == [4, 5] and state["next_index"] == 6
    resumed_driver = ScriptedDriver(2)
    resumed_driver.weight_sync.version = version
    second = RolloutPipeline(resumed_driver, max_staleness=2, lead=2, drop=False, seed=3, version=version,
                             next_index=state["next_index"], pending=tuple(state["in_flight"]))
    try:
        more, _ = train(second, resumed_driver, range(6, 10), version=version)
    finally:
        second.close()
    assert [i for i, _ in trained + more] == list(range(8))  # none twice, none skipped
    assert [i for i, _, _ in resumed_driver.calls][:2] == [4, 5]  # generated again, first


def test_producer_error_reaches_the_trainer():
    driver = ScriptedDriver(0)
    driver.rollout = lambda plan, step, seed_key, **_: (_ for _ in ()).throw(RuntimeError("engine died"))
    pipeline = RolloutPipeline(driver, max_staleness=0, lead=0, drop=False, seed=0)
    try:
        with pytest.raises(RuntimeError, match="engine died"):
            pipeline.exchange(batch(0), plan_of, version=0, step=0)
    finally:
        pipeline.close()
    assert not pipeline.producer._thread.is_alive()


@pytest.mark.parametrize("bad", [{"max_staleness": -1}, {"max_staleness": 1.5}, {"mode": "asynch"},
                                 {"stale_strategy": "evict"}, {"partial_rollout": "yes"}, {"kv_at_swap": "drop"}])
def test_settings_refused_in_one_line(bad):
    with pytest.raises(ConfigError, match=f"rollout.{next(iter(bad))}"):
        RolloutConfig(**bad)


def test_lead():
    assert RolloutConfig().lead == 0  # sync
    assert RolloutConfig(mode="async", max_staleness=2).lead == 2
    assert RolloutConfig(mode="async", max_staleness=2, stale_strategy="drop").lead == 3


@dataclass
class Scored:
    plan: RolloutPlan
    logp: torch.Tensor


def test_held_bytes_counts_each_storage_once():
    big = torch.zeros(256)  # 1 KiB
    value = [Scored(None, big), {"view": big[:10], "other": torch.zeros(8, dtype=torch.int64)}, None, "text", 3]
    assert held_bytes(value) == 1024 + 64


def test_buffer_metric_is_the_scored_batches_held():
    """`async/buffer_mb`: the batch the step takes and those generated ahead of it (1 KiB each here), not those
    still to generate."""
    gate = threading.Event()

    class ScoringDriver(ScriptedDriver):
        def rollout(self, plan, **kwargs):
            if plan.answers[0] == 2:  # batch 2 stays ungenerated until the test has read the buffer
                assert gate.wait(timeout=60)
            super().rollout(plan, **kwargs)
            return Scored(plan, torch.zeros(256))

    driver = ScoringDriver(0, max_s=0.0)
    pipeline = RolloutPipeline(driver, max_staleness=2, lead=2, drop=False, seed=0)
    try:
        assert pipeline.exchange(batch(0), plan_of, version=0, step=0) is None
        assert pipeline.exchange(batch(1), plan_of, version=0, step=0) is None
        assert all(item.done.wait(timeout=60) for item in pipeline.in_flight)  # batches 0 and 1 generated
        taken = pipeline.exchange(batch(2), plan_of, version=0, step=0)
        assert taken.index == 0 and [i.index for i in pipeline.in_flight] == [1, 2]
        assert pipeline.buffer_bytes == 2 * 1024  # batch 0 (taken) and 1 (ahead); 2 is not generated
        rollouts = SimpleNamespace(policy_version=torch.zeros(2), token_version=None, num_samples=2)
        assert float(pipeline.metrics(rollouts, version=0)["async/buffer_mb"]) == 2 * 1024 / 2**20
    finally:
        gate.set()
        pipeline.close()


class HungDriver(ScriptedDriver):
    """A generation that never ends by itself (a frozen engine, a call that cannot be cut) until `release` is set."""

    def __init__(self):
        super().__init__(0)
        self.release, self.started = threading.Event(), threading.Event()

    def rollout(self, plan, **kwargs):
        self.started.set()
        self.release.wait(30)
        return SimpleNamespace(plan=plan)


@pytest.mark.parametrize("wait", ["batch", "engine"], ids=["the batch", "the engine between batches"])
def test_a_hung_producer_does_not_defer_a_stop_request_past_its_grace(wait):
    """Issue 61, class 4: the trainer's waits for the producer (its batch, the engine for a push) give up once a stop
    request is older than `stop_grace_s`, and `close` does not wait for the hung producer any longer after that."""
    driver = HungDriver()
    pipeline = RolloutPipeline(driver, max_staleness=1, lead=1, drop=False, seed=7)
    STOP.arm(0.3)
    try:
        pipeline.exchange(batch(0), plan_of, version=0, step=0)  # the pipeline fills: no wait
        assert driver.started.wait(10)
        STOP.request("SIGTERM")
        t0 = time.monotonic()
        with pytest.raises(StopRequested):
            if wait == "batch":
                pipeline.exchange(batch(1), plan_of, version=0, step=0)
            else:
                with pipeline.engine_access():
                    pass
        assert 0.3 <= time.monotonic() - t0 < 3
        assert pipeline.producer._held == 0  # a give-up leaves the engine to the producer
        t0 = time.monotonic()
        pipeline.close()
        assert time.monotonic() - t0 < 3  # about 2 s for the hung producer, not close's 60 s
    finally:
        STOP.arm(None)
        driver.release.set()
