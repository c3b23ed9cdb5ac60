"""`rollout.mode=async` composes with the algorithms, the decoupled objective, LoRA and environments, or is refused in
one line before the model loads, saying why (docs/async.md). Short in-process `train.py` runs on the tiny model with
the HF engine; the SGLang and vLLM engines run async in the live stages."""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from pathlib import Path

import pytest
import torch
from recipe_runs import train_in_process

from lit_rlvr.callbacks.oracle_baseline import OracleBaseline
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.settings import AlgorithmConfig, RolloutConfig
from lit_rlvr.hooks import check_rl_callbacks
from lit_rlvr.module import GRPOModule
from lit_rlvr.optim import IVON, sample_seed
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.pipeline import RolloutPipeline
from lit_rlvr.rollout.weight_sync import WeightSync

ASYNC = ("rollout.mode=async", "rollout.max_staleness=1")


def run(tmp_path: Path, tiny_path: str, *overrides: str) -> tuple[dict, list[dict]]:
    return train_in_process(tmp_path, [
        f"model.name_or_path={tiny_path}", "trainer.max_steps=3", "data.batch_size=2", "data.num_test=2",
        "eval_before=false", "callbacks.progress=null", "algorithm.group_size=4", "algorithm.max_new_tokens=6",
        *ASYNC, *overrides])


@pytest.mark.parametrize("overrides, column", [
    (("algorithm=grpo",), "loss/policy"),
    (("algorithm=dr_grpo",), "loss/policy"),
    (("algorithm=gspo",), "loss/policy"),
    (("algorithm=dapo", "algorithm.filter_groups.enable=false"), "loss/policy"),
    (("algorithm.rollout_correction.rollout_is=token",), "mismatch/is_clip_frac"),  # AReaL's decoupled objective
    # the calculator's turns with the HF engine in a process of its own, 3PO's sample pushes and LoRA adapters
    # through its socket (the calculator in the producer's thread: the partial-rollout test below)
    (("env=calculator", "algorithm.max_new_tokens=8", "engine.options.process=true", "algorithm=c3po",
      "model.lora.rank=4"), "env/turns_mean"),
], ids=["grpo", "dr_grpo", "gspo", "dapo-no-filter", "decoupled", "calculator-process-c3po-lora"])
def test_async_composes(overrides, column, tiny_path, tmp_path):
    """(LoRA, adapter and merged pushes: in the 3PO and the partial-rollout tests below, which push the mean's
    adapters after every update too.)"""
    summary, rows = run(tmp_path, tiny_path, *overrides)
    assert len(rows) >= 2 and summary["optimizer_steps"] >= 3  # GSPO: 2 optimizer steps an update
    assert [float(r["async/staleness_max"]) for r in rows] == [0.0] + [1.0] * (len(rows) - 1)  # in updates
    for row in rows:
        assert math.isfinite(float(row["loss/policy"])) and row[column] != ""
        assert 0 <= float(row["async/trainer_wait_frac"]) <= 1


@pytest.mark.parametrize("overrides, says", [
    (("algorithm=dapo",), "filter_groups"),
    (("algorithm=c3po", "rollout.stale_strategy=drop"), "every batch would arrive too stale"),
    (("algorithm.rollout_correction.bypass_mode=false",), "would not correct for the lag"),
    (("engine.options.mode=shared",), "needs its own copy"),
], ids=["dapo", "c3po-drop", "no-correction", "shared-engine"])
def test_async_refusals_say_why(overrides, says, tiny_path, tmp_path):
    with pytest.raises(ConfigError, match=says) as caught:
        run(tmp_path, tiny_path, *overrides)
    assert "\n" not in str(caught.value) and "rollout.mode=async" in str(caught.value)


@pytest.mark.parametrize("overrides, says", [
    (("algorithm=c3po", "engine.options.sync_check_every=0"), "would continue under the new mean"),
    (("engine=sglang", "engine.options.sync_check_every=0"), "set rollout.kv_at_swap=recompute"),
    (("rollout.mode=sync",), "needs rollout.mode=async"),
    (("rollout.mode=async",), "none would land mid-batch"),  # (the post-push check after every push: the default)
], ids=["c3po", "sglang", "sync", "check-every-push"])
def test_partial_rollout_refusals_say_why(overrides, says, tiny_path, tmp_path):
    with pytest.raises(ConfigError, match=says) as caught:
        mode = [] if any(o.startswith("rollout.mode") for o in overrides) else ["rollout.mode=async"]
        train_in_process(tmp_path, [f"model.name_or_path={tiny_path}", "rollout.partial_rollout=true", *mode,
                                    *overrides])
    assert "\n" not in str(caught.value) and "rollout.partial_rollout=true" in str(caught.value)


@pytest.mark.parametrize("kv, extra", [
    ("keep", ()), ("recompute", ()), ("recompute", ("env=calculator",)), ("keep", ("model.lora.rank=4",)),
    ("recompute", ("model.lora.rank=4", "engine.options.lora_sync=merged")),
], ids=["keep", "recompute", "calculator", "lora-adapter", "lora-merged"])
def test_partial_rollouts_land_each_push_in_the_batch_being_generated(kv, extra, tiny_path, tmp_path, monkeypatch):
    """A handshake makes every push land inside a batch: the trainer's push waits until the producer is decoding,
    and the producer holds the first decode step of each batch after the first until that push is staged. Each
    completion then holds tokens of two versions in order, and the bound reads its oldest."""
    decoding, pushed, trained, calls = threading.Event(), threading.Event(), [], itertools.count()
    pushing, forward, generate = RolloutPipeline.pushing, HFEngine._forward, HFEngine.generate
    held = threading.local()

    @contextlib.contextmanager
    def pushing_spy(self, version):
        decoding.wait(timeout=10)
        with pushing(self, version):
            yield
        pushed.set()

    def generate_spy(self, *args, **kwargs):  # the first batch meets no push: the trainer waits for it
        held.waiting = threading.current_thread().name == "lit-rlvr-producer" and next(calls) > 0
        try:
            return generate(self, *args, **kwargs)
        finally:
            decoding.clear()

    def forward_spy(self, ids, *args, **kwargs):
        out = forward(self, ids, *args, **kwargs)
        if ids.shape[1] == 1 and getattr(held, "waiting", False):  # the call's first decode step
            held.waiting = False
            decoding.set()
            if pushed.wait(timeout=10):
                pushed.clear()
        return out

    collect = GRPOModule.collect

    def collect_spy(self, batch):
        rollouts = collect(self, batch)
        if rollouts is not None:
            trained.append(rollouts)
        return rollouts

    for cls, name, spy in ((RolloutPipeline, "pushing", pushing_spy), (HFEngine, "_forward", forward_spy),
                           (HFEngine, "generate", generate_spy), (GRPOModule, "collect", collect_spy)):
        monkeypatch.setattr(cls, name, spy)
    summary, rows = run(tmp_path, tiny_path, "rollout.partial_rollout=true", f"rollout.kv_at_swap={kv}",
                        "algorithm.ignore_eos=true", "engine.options.sync_check_every=0", *extra)
    assert summary["optimizer_steps"] == len(rows) == 3
    assert [float(r["async/staleness_max"]) for r in rows] == [0.0, 1.0, 1.0]  # the oldest token's version
    assert [float(r["async/partial_frac"]) for r in rows][1:] == [1.0, 1.0]  # the first batch met no push
    for update, rollouts in enumerate(trained[1:], start=1):  # planned at update - 1, finished under update
        sampled = rollouts.token_version[rollouts.response_mask]
        assert set(sampled.tolist()) == {update - 1, update}
        assert rollouts.policy_version.tolist() == [update - 1] * rollouts.num_samples
        for row in rollouts.token_version:  # segments in order: a version never goes back
            assert (row[1:] >= row[:-1]).logical_or(row[1:] == 0).all()


def test_callbacks_that_read_the_steps_weights_are_refused_in_async_mode():
    """OracleBaseline draws its samples with the weights of the step that trains the batch, which did not make it."""
    with pytest.raises(ConfigError, match="rollout.mode=async: OracleBaseline draws its oracle samples") as caught:
        check_rl_callbacks([OracleBaseline()], AlgorithmConfig(), RolloutConfig(mode="async"))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("variant, num_samples, lora", [
    ("c3po", 4, ()), ("b3po", 1, ()), ("m3po", 2, ()), ("c3po", 4, ("model.lora.rank=4",)),
    ("c3po", 2, ("model.lora.rank=4", "engine.options.lora_sync=merged"))],  # N > 2: drawn when pushed
    ids=["c3po", "b3po", "m3po", "c3po-lora-adapter", "c3po-lora-merged"])
def test_3po_async_draws_its_samples_at_plan_time_and_the_producer_never_touches_the_policy(
        variant, num_samples, lora, tiny_path, tmp_path, monkeypatch):
    """The producer generates with weight samples drawn in the trainer's thread when the batch was planned (version
    v, IVON's seeding at step v); it never writes the trainer's parameters nor pushes them. On LoRA the samples are
    the adapters', pushed as adapters or merged into the base."""
    producer_calls: list[str] = []  # what the producer thread did that it must not
    trained = []  # each update's rollouts

    def spy(name, method):
        def wrapped(*args, **kwargs):
            if threading.current_thread().name == "lit-rlvr-producer":
                producer_calls.append(name)
            return method(*args, **kwargs)
        return wrapped

    for cls, name in ((IVON, "_sample_params"), (IVON, "_write_means"), (IVON, "sampled_stack"), (IVON, "_update"),
                      (WeightSync, "push")):  # every write of the parameters, and every read of them for a push
        monkeypatch.setattr(cls, name, spy(f"{cls.__name__}.{name}", getattr(cls, name)))
    collect = GRPOModule.collect

    def collect_spy(self, batch):
        rollouts = collect(self, batch)
        if rollouts is not None:
            trained.append((self.counters["rl_steps"], rollouts))
        return rollouts

    monkeypatch.setattr(GRPOModule, "collect", collect_spy)
    summary, rows = run(tmp_path, tiny_path, f"algorithm={variant}",
                        f"algorithm.callbacks.param_noise.num_samples={num_samples}", *lora)
    assert producer_calls == []
    assert len(trained) == len(rows) >= 2 and summary["optimizer_steps"] == len(rows)
    assert [float(r["async/staleness_max"]) for r in rows] == [0.0] + [1.0] * (len(rows) - 1)
    for update, rollouts in trained:
        version = update - 1 if update else 0  # S = 1: planned one update earlier (the first: before any)
        assert rollouts.policy_version.tolist() == [version] * rollouts.num_samples
        assert rollouts.sample_index.tolist() == rollouts.source.tolist()
        assert sorted(set(rollouts.sample_index.tolist())) == list(range(num_samples))
        want = [sample_seed(0, version, j, 0, 0) for j in rollouts.sample_index.tolist()]  # IVON's, at step v
        assert rollouts.sample_seed.tolist() == want
    for row in rows:
        assert math.isfinite(float(row["loss/policy"])) and row["noise/sigma_mean"] != ""


@pytest.mark.parametrize("num_samples", [2, 3], ids=["drawn-now", "drawn-when-pushed"])
def test_snapshot_holds_the_bits_sampled_params_writes(num_samples):
    """`snapshot_posterior`'s source j is what `IVON.sampled_params(j)` writes into the policy at that step, also
    when it is drawn later in another thread after the trainer has stepped (N > 2: from a copy of m and 1/σ, two
    copies of the weights whatever N; N ≤ 2: the samples themselves, N copies)."""
    from lit_rlvr.callbacks.param_noise import snapshot_posterior
    from lit_rlvr.rollout.batch import RolloutPlan

    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    optimizer = IVON(policy.parameters(), lr=0.1, ess=1e4, seed=7)
    plan = RolloutPlan(["p"], [None], [[1]], [4])
    nbytes = snapshot_posterior(plan, optimizer, num_samples, policy)
    weights = sum(p.numel() * 4 for p in policy.parameters())
    assert nbytes == (2 if num_samples > 2 else num_samples) * weights
    assert plan.num_weight_sources == num_samples and not plan.uses_mean_weights
    means = {name: p.detach().clone() for name, p in policy.named_parameters()}
    written = []
    for j in range(num_samples):
        with optimizer.sampled_params(sample_index=j):
            written.append({name: p.detach().clone() for name, p in policy.named_parameters()})
    for p in policy.parameters():  # the trainer steps on: the snapshot must not follow
        p.grad = torch.ones_like(p)
    with optimizer.sampled_params(train=True):
        pass
    optimizer.step()
    drawn = [None] * num_samples
    producer = threading.Thread(target=lambda: drawn.__setitem__(slice(None), [
        dict(plan.source_weights(j)) for j in range(num_samples)]))
    producer.start(), producer.join()
    for j in range(num_samples):
        assert drawn[j].keys() == written[j].keys()
        assert all(torch.equal(drawn[j][n], written[j][n]) for n in written[j])  # same draw, same ops: same bits
        assert not all(torch.equal(drawn[j][n], means[n]) for n in means)  # a sample, not the mean
    assert not torch.equal(next(policy.parameters()), next(iter(means.values())))  # (the step moved m)
    assert plan.source_seeds == [sample_seed(7, 0, j, 0, 0) for j in range(num_samples)]


@pytest.mark.parametrize("algorithm", ["v05", "c3po_v05"])
def test_v05_async_allocates_with_the_prior_of_plan_time(algorithm, tiny_path, tmp_path, monkeypatch):
    """OSLA's extra rounds run in the producer with the prior predicted when the batch was planned; each batch's
    completions carry the version of the context that predicted it, and its baseline is fused with that prior."""
    trained = []
    collect = GRPOModule.collect

    def collect_spy(self, batch):
        rollouts = collect(self, batch)
        if rollouts is not None:
            trained.append((self.counters["rl_steps"], rollouts))
        return rollouts

    monkeypatch.setattr(GRPOModule, "collect", collect_spy)
    summary, rows = run(tmp_path, tiny_path, f"algorithm={algorithm}", "algorithm.callbacks.value_prior.min_context=2",
                        "algorithm.callbacks.value_prior.k_init=2", "algorithm.callbacks.value_prior.k_max=4",
                        "algorithm.callbacks.value_prior.pad_to=1", "trainer.max_steps=4")
    assert len(rows) == len(trained) >= 3
    assert any(r.num_samples > 2 * r.num_groups for _, r in trained)  # the producer ran OSLA's extra rounds
    assert [float(r["async/staleness_max"]) for r in rows] == [0.0] + [1.0] * (len(rows) - 1)
    for update, rollouts in trained:
        version = max(update - 1, 0)  # planned one update earlier: the context held that many steps' records
        assert rollouts.prior_version.tolist() == [version] * rollouts.num_samples
        assert rollouts.baseline is not None and rollouts.baseline.shape == (rollouts.num_groups,)
    assert [float(r["v05/context_size"]) for r in rows] == [0.0, 0.0] + [2.0 * u for u in range(1, len(rows) - 1)]
    assert float(rows[-1]["v05/prior_present"]) == 1.0  # the prior came in once the context held 2 records


def test_snapshot_memory_warns_past_half_the_free_memory():
    from lit_rlvr.callbacks.param_noise import snapshot_memory_warning

    assert snapshot_memory_warning(2**30, 2, free=4 * 2**30) is None  # 2 GiB of 4 free
    message = snapshot_memory_warning(2**30, 3, free=4 * 2**30)
    assert "1.00 GiB a batch, up to 3 batches" in message and "rollout.max_staleness" in message
    assert snapshot_memory_warning(2**40, 3, free=None) is None  # free memory unknown: nothing to compare
