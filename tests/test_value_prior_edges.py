"""Edges that scripts/mutation.py found unchecked (docs/mutation.md): each test kills named mutants."""

import inspect
import itertools
import logging
from dataclasses import replace
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.callbacks import ValuePrior
from lit_rlvr.callbacks.value_prior import _Step, _warn_unused_settings
from lit_rlvr.functional import value_prior as lib
from lit_rlvr.hooks import check_rl_callbacks
from lit_rlvr.value import ValueModel
from test_value_prior_callback import _Source, fake_rollouts, plan_for

ROOT = Path(__file__).resolve().parents[1]
NAN = math.nan


# ----------------------------------------------------------------------------------------------- helpers


class StubV0:
    """A value model with known predictions: p̂ by prompt text (`default` for others)."""

    def __init__(self, p_hat: dict, default: float = 0.5):
        self.p_hat, self.default = p_hat, default

    def predict(self, prompts, context):
        return torch.tensor([self.p_hat.get(p, self.default) for p in prompts]), {}


class PrefetchV0(StubV0):
    """A stub V0 that can compute features ahead: records each `precompute` call, says it took `seconds`."""

    def __init__(self, seconds: float = 0.5):
        super().__init__({})
        self.seconds, self.calls = seconds, []

    def precompute(self, prompts, batch_size):
        self.calls.append((list(prompts), batch_size))
        return self.seconds


class MetricSink:
    """Stands in for the module in hook calls: collects what the callback logs (one step's metrics)."""

    def __init__(self):
        self.metrics = {}

    def log_metrics(self, metrics):
        self.metrics = {k: float(v) for k, v in metrics.items()}


def ready(value_model, **kwargs) -> ValuePrior:
    """A ValuePrior whose context is already past min_context."""
    cb = ValuePrior(value_model=value_model, min_context=1, context_size=8, **{"k_init": 4, **kwargs})
    cb.context.add(["old"], [0.5], [4])
    return cb


def one_step(cb: ValuePrior, prompts, rewards) -> dict:
    """Plan, fusion and step end of one step without extra rounds; returns what the step logged."""
    sink = MetricSink()
    cb.on_rollout_plan(None, sink, plan_for(prompts))
    rollouts = fake_rollouts(prompts, rewards)
    cb.on_before_advantages(None, sink, rollouts)
    cb.on_rl_step_end(None, sink, rollouts)
    return sink.metrics


def fake_trainer(num_prompts: int, batch_size: int, max_steps: int, shuffle: bool = False):
    """What on_train_start reads of a Trainer: a train loader of {'prompt': ...} rows, max_steps, the epoch."""
    rows = [{"prompt": f"q{i}"} for i in range(num_prompts)]
    loader = DataLoader(rows, batch_size=batch_size, shuffle=shuffle)  # sequential sampler: the order is known
    return types.SimpleNamespace(train_dataloader=loader, max_steps=max_steps, current_epoch=0)


def fake_module():
    """What the prompt prefetch reads of the module: its tokenizer and chat-template setting (plain text here)."""
    return types.SimpleNamespace(tokenizer=None, settings=types.SimpleNamespace(model=types.SimpleNamespace(
        chat_template=False)))


# ----------------------------------------------------------------------------------------------- functional: edges


def test_ieee_division_by_zero_gives_nan_for_zero_or_nan_and_signed_inf_otherwise():
    """`_div` is IEEE a / b: 0/0 and NaN/0 are NaN; x/±0 is ±inf with the sign of x times the sign of the zero."""
    assert math.isnan(lib._div(0.0, 0.0)) and math.isnan(lib._div(NAN, 0.0)) and math.isnan(lib._div(-0.0, -0.0))
    assert lib._div(2.0, 0.0) == math.inf and lib._div(-2.0, 0.0) == -math.inf
    assert lib._div(2.0, -0.0) == -math.inf and lib._div(-2.0, -0.0) == math.inf
    assert lib._div(1.0, 4.0) == 0.25


def test_osla_never_asks_past_k_max():
    """OSLA asks for sample k+1 only while k < k_max: at k = k_max it stops however large the gain."""
    assert lib.osla_wants_more([1.0, 1.0, 1.0], [15, 16, 17], cost=0.0039, k_max=16) == [True, False, False]


def test_group_mean_of_a_single_sample_is_that_sample():
    """A group of one has its one reward as mean; an empty group has mean 0 and count 0."""
    means, counts = lib.group_mean_py([1.0, -1.0, -1.0], [0, 2, 2], 3)
    assert means == [1.0, 0.0, -1.0] and counts == [1, 0, 2]


@pytest.mark.parametrize("kwargs", [dict(round_size=0), dict(pad_to=0), dict(min_active_frac=1.01),
                                    dict(min_active_frac=1.5), dict(min_active_frac=-0.01)])
def test_allocate_round_rejects_each_bad_option_alone(kwargs):
    """round_size ≥ 1, pad_to ≥ 1, 0 ≤ min_active_frac ≤ 1: each one out of range raises by itself."""
    options = {"k_max": 8, "min_active_frac": 0.25, "pad_to": 1, "round_size": 1, **kwargs}
    with pytest.raises(ValueError, match="allocate_round needs"):
        lib.allocate_round([True, False], [0.1, 0.0], [4, 4], **options)


def test_allocate_round_accepts_min_active_frac_at_both_ends():
    """min_active_frac = 0 and = 1 are valid: 0 extends any asking prompt, 1 only when every prompt asks."""
    wants, gain, counts = [True, False], [0.1, 0.0], [4, 4]
    assert lib.allocate_round(wants, gain, counts, k_max=8, min_active_frac=0.0, pad_to=1, round_size=1) == [1, 0]
    assert lib.allocate_round(wants, gain, counts, k_max=8, min_active_frac=1.0, pad_to=1, round_size=1) == [0, 0]
    assert lib.allocate_round([True, True], gain, counts, k_max=8, min_active_frac=1.0, pad_to=1,
                              round_size=1) == [1, 1]


def test_a_prompt_already_at_k_max_does_not_count_as_asking():
    """A prompt with no room below k_max cannot get a sample, so it is not among the prompts that ask: here 1 of
    3 ask with room (< min_active_frac = 0.5), and no round is generated."""
    extra = lib.allocate_round([True, True, False], [0.1, 0.1, 0.0], [8, 4, 4], k_max=8, min_active_frac=0.5,
                               pad_to=1, round_size=1)
    assert extra == [0, 0, 0]
    # with the third prompt asking too, 2 of 3 ask with room: the round goes ahead, the full prompt gets none
    extra = lib.allocate_round([True, True, True], [0.1, 0.1, 0.1], [8, 4, 4], k_max=8, min_active_frac=0.5,
                               pad_to=1, round_size=1)
    assert extra == [0, 1, 1]


# ----------------------------------------------------------------------------------------------- callback: options


def test_constructor_defaults_are_the_documented_config():
    """Without Hydra the constructor's defaults are conf/algorithm/callbacks/value_prior.yaml's (seed: the run's
    default seed in conf/config.yaml)."""
    documented = yaml.safe_load((ROOT / "conf/algorithm/callbacks/value_prior.yaml").read_text())
    documented.pop("_target_")
    documented["seed"] = yaml.safe_load((ROOT / "conf/config.yaml").read_text())["seed"]
    params = inspect.signature(ValuePrior).parameters
    for name, value in documented.items():
        default = params[name].default
        assert (list(default) if isinstance(default, tuple) else default) == value, name
    cb = ValuePrior(value_model=StubV0({}))
    assert (cb.k_max, cb.pad_to, cb.precompute_max, cb.precompute_batch) == (16, 32, 8192, 256)
    assert (cb.context.capacity, cb.context.min_context) == (256, 32)
    kw = cb.value_model_kwargs
    assert (kw["max_length"], kw["seed"], kw["bandwidth_refit"]) == (128, 0, 0.25)


def test_k_max_of_one_is_valid_while_k_init_waits_for_group_size():
    """k_init None takes the module's group_size later: k_max = 1 is valid (a first round of 1 fits), and a
    group_size of 1 then gives k_init = 1."""
    cb = ValuePrior(k_max=1, value_model=StubV0({}))
    cb.check_algorithm(AlgorithmConfig(group_size=1, scale_adv_by_std=False))
    assert cb.k_init == 1
    with pytest.raises(ValueError, match="k_init=2 is larger"):
        cb.check_algorithm(AlgorithmConfig(group_size=2, scale_adv_by_std=False))


def test_value_prior_sets_the_sample_counts_so_a_group_of_one_is_allowed():
    """V0.5 decides each prompt's sample count (`sets_sample_counts`): the module's group_size of 1 passes the
    check that rejects it for plain GRPO."""
    assert ValuePrior.sets_sample_counts is True
    check_rl_callbacks([ValuePrior(k_init=1, value_model=StubV0({}))], AlgorithmConfig(group_size=1))


def test_unused_settings_are_reported_and_said_once(caplog):
    """A group_size other than k_init and scale_adv_by_std=true each warn (and return True); matching options
    say nothing (False); the callback says it at most once over its two checks."""
    v05 = AlgorithmConfig(group_size=4, scale_adv_by_std=False)  # conf/algorithm/v05.yaml's
    assert _warn_unused_settings(v05, 4) is False
    with caplog.at_level(logging.WARNING):
        assert _warn_unused_settings(replace(v05, group_size=8), 4) is True
    assert "group_size=8 is not used" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _warn_unused_settings(replace(v05, scale_adv_by_std=True), 4) is True
    assert "scale_adv_by_std=true" in caplog.text and "is not used" not in caplog.text

    cb = ValuePrior(k_init=4, value_model=StubV0({}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cb.check_algorithm(AlgorithmConfig(group_size=4, scale_adv_by_std=False))  # nothing to say
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING):
        cb.check_algorithm(AlgorithmConfig(group_size=8, scale_adv_by_std=False))
    assert caplog.text.count("is not used") == 1
    with caplog.at_level(logging.WARNING):
        cb.check_algorithm(AlgorithmConfig(group_size=8, scale_adv_by_std=False))  # setup checks again: said once
    assert caplog.text.count("is not used") == 1


# ----------------------------------------------------------------------------------------------- callback: precompute


def test_precompute_all_computes_every_training_prompt_at_train_start_and_logs_it_once():
    """"all": the whole training set at train start, `precompute_batch` per call, nothing per step; its seconds
    are logged as time/prior_setup_s at the first step only, time/prior_prefetch_s is 0 at every step."""
    v0 = PrefetchV0(seconds=0.5)
    cb = ready(v0, precompute="all", precompute_batch=3)
    trainer = fake_trainer(10, 4, max_steps=-1)
    cb.on_train_start(trainer, fake_module())
    assert v0.calls == [([f"q{i}" for i in range(10)], 3)]
    for step in range(2):
        cb.on_train_batch_start(trainer, None, None, step)
        m = one_step(cb, ["a"], [[1.0, -1.0]])
        assert m["time/prior_prefetch_s"] == 0.0
        assert m.get("time/prior_setup_s") == (0.5 if step == 0 else None)
    assert len(v0.calls) == 1


def test_precompute_off_computes_nothing_ahead():
    """"off": no features ahead even from a model that can; nothing ahead logged but a prefetch time of 0."""
    v0 = PrefetchV0()
    cb = ready(v0, precompute="off")
    trainer = fake_trainer(10, 4, max_steps=-1)
    cb.on_train_start(trainer, fake_module())
    cb.on_train_batch_start(trainer, None, None, 0)
    m = one_step(cb, ["a"], [[1.0, -1.0]])
    assert v0.calls == [] and m["time/prior_prefetch_s"] == 0.0 and "time/prior_setup_s" not in m


def test_without_precompute_the_first_steps_log_no_time_ahead():
    """A value model without `precompute`: every step logs time/prior_prefetch_s = 0 and no setup time."""
    cb = ready(StubV0({}))
    cb.on_train_start(fake_trainer(10, 4, max_steps=-1), fake_module())
    for _ in range(2):
        m = one_step(cb, ["a"], [[1.0, -1.0]])
        assert m["time/prior_prefetch_s"] == 0.0 and "time/prior_setup_s" not in m


def test_precompute_next_computes_each_chunk_of_coming_prompts_when_its_first_batch_starts():
    """"next": `precompute_max // batch_size` batches (here 42 // 4 = 10: 40 prompts) at a time in the sampler's
    order, at the batch that starts a chunk; the seconds are logged as that step's time/prior_prefetch_s."""
    v0 = PrefetchV0(seconds=0.25)
    cb = ready(v0, precompute="next", precompute_max=42, precompute_batch=5)
    trainer = fake_trainer(100, 4, max_steps=-1)
    cb.on_train_start(trainer, fake_module())
    assert v0.calls == []  # nothing at train start
    logged = []
    for batch_idx in range(11):
        cb.on_train_batch_start(trainer, None, None, batch_idx)
        logged.append(one_step(cb, ["a"], [[1.0, -1.0]])["time/prior_prefetch_s"])
    assert v0.calls == [([f"q{i}" for i in range(40)], 5), ([f"q{i}" for i in range(40, 80)], 5)]
    assert logged == [0.25] + [0.0] * 9 + [0.25]


@pytest.mark.parametrize("precompute_max, max_steps, prompts_ahead", [
    (40, -1, 40),  # no step limit: precompute_max // batch_size = 10 batches
    (40, 3, 12),  # a chunk never covers more than the run's max_steps: 3 batches
    (40, 1, 4),  # ... down to a run of one step
    (3, -1, 4),  # fewer than one batch's prompts allowed: still one batch at a time
])
def test_next_chunk_size(precompute_max, max_steps, prompts_ahead):
    """The "next" chunk: precompute_max // batch_size batches (batch_size 4), at most max_steps, at least one."""
    v0 = PrefetchV0()
    cb = ValuePrior(value_model=v0, precompute="next", precompute_max=precompute_max)
    trainer = fake_trainer(100, 4, max_steps=max_steps)
    cb.on_train_start(trainer, fake_module())
    cb.on_train_batch_start(trainer, None, None, 0)
    assert v0.calls == [([f"q{i}" for i in range(prompts_ahead)], 256)]


@pytest.mark.parametrize("size, max_steps, ordered, expected", [
    (9, 1, True, "next"),  # a one-step run draws 8 prompts < 9: only what it draws
    (8, 1, True, "all"),  # ... and all when the set is no larger than that
    (100, 5, False, "all"),  # no order, the set exactly fits precompute_max (100): all
    (101, 5, False, "off"),  # ... one more: in the steps
])
def test_auto_precompute_at_its_boundaries(size, max_steps, ordered, expected):
    """"auto" (batch_size 8, precompute_max 100): "all" when the set is ≤ both precompute_max and what the run
    draws (max_steps × batch_size), else "next" where the order is known, else "all" if it fits, else "off"."""
    cb = ValuePrior(value_model=StubV0({}), precompute="auto", precompute_max=100)
    assert cb._resolve_precompute(_Source(size, 8, ordered), max_steps) == expected


def test_precompute_asked_for_without_a_dataset_warns_and_auto_does_not(caplog):
    """An explicit "all"/"next" that cannot be honored says so; "auto" falls back to "off" silently."""
    with caplog.at_level(logging.WARNING):
        assert ValuePrior(value_model=StubV0({}), precompute="auto")._resolve_precompute(None, 10) == "off"
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING):
        assert ValuePrior(value_model=StubV0({}), precompute="next")._resolve_precompute(None, 10) == "off"
    assert "precompute=next needs a train dataloader" in caplog.text


# ----------------------------------------------------------------------------------------------- callback: the step


def test_budget_rule_asks_for_a_single_extra_sample():
    """One prompt whose prior is wrong, pad_to = 1: the next round is exactly one sample, not a stop."""
    cb = ready(StubV0({"a": 0.95}), pad_to=1)
    plan = plan_for(["a"])
    cb.on_rollout_plan(None, None, plan)
    assert plan.budget_rule(fake_rollouts(["a"], [[-1.0] * 4])) == [1]


def test_prior_seconds_add_up_every_hooks_span(monkeypatch):
    """time/prior_s sums the time spent in the plan, in each round's budget rule, in the fusion and at the step
    end: with a clock that advances 1 s between its readings, 5 spans (2 rounds) give 5 s."""
    clock = itertools.count()
    monkeypatch.setattr(sys.modules[ValuePrior.__module__], "time",
                        types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    cb = ready(StubV0({"a": 0.95}), pad_to=1, k_max=5)
    plan = plan_for(["a"])
    sink = MetricSink()
    cb.on_rollout_plan(None, sink, plan)
    assert plan.budget_rule(fake_rollouts(["a"], [[-1.0] * 4])) == [1]
    assert plan.budget_rule(fake_rollouts(["a"], [[-1.0] * 5])) is None  # k_max reached
    rollouts = fake_rollouts(["a"], [[-1.0] * 5])
    cb.on_before_advantages(None, sink, rollouts)
    cb.on_rl_step_end(None, sink, rollouts)
    assert sink.metrics["time/prior_s"] == 5.0


def test_group_stats_are_computed_once_per_rollouts_state():
    """The same rollouts give the very same (shared) lists; a new rewards tensor, a new group tensor or an
    in-place change of either gives the new state's means and counts."""
    cb, step = ValuePrior(value_model=StubV0({})), _Step()
    r = fake_rollouts(["a", "b"], [[1.0, 1.0], [-1.0, -1.0]])
    first = cb._group_stats(r, step)
    assert first == ([1.0, -1.0], [2, 2])
    assert cb._group_stats(r, step) is first
    r.rewards = torch.tensor([-1.0, -1.0, 1.0, 1.0])  # new tensor, same group tensor, same versions
    assert cb._group_stats(r, step) == ([-1.0, 1.0], [2, 2])
    r.group = torch.tensor([0, 1, 1, 0])  # new tensor, same rewards tensor
    assert cb._group_stats(r, step) == ([0.0, 0.0], [2, 2])
    held = cb._group_stats(r, step)
    assert cb._group_stats(r, step) is held
    r.rewards[0] = 1.0  # in place: its version counter moves
    assert cb._group_stats(r, step) == ([1.0, 0.0], [2, 2])
    r.group[2] = 0
    assert cb._group_stats(r, step) == ([1.0, -1.0], [3, 1])


def test_metrics_with_a_prior_for_some_prompts_only():
    """Where V0 gives no prior (NaN) for some prompts, the prior metrics are over the prompts with one and the
    per-sample AUC (which needs every sample scored) is NaN."""
    cb = ready(StubV0({"a": 0.75, "b": NAN}))
    m = one_step(cb, ["a", "b"], [[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 1.0, -1.0]])
    assert m["v05/p_hat_mean"] == 0.75
    assert m["v05/prior_abs_err"] == pytest.approx(0.25)  # |0.75 − 1.0|
    assert m["v05/prior_rejected_frac"] == 0.0  # a: (1 − 0.5)² = 0.25 ≤ σ²/k = 0.25, not rejected
    assert math.isnan(m["v05/prior_auc"])


def test_prior_auc_labels_a_success_as_a_reward_above_the_ranges_midpoint():
    """On rewards in [0, 1] a sample succeeds when its reward is above ½: 1.0 does, 0.5 (the midpoint) and 0.4
    do not. p̂: a 0.8 (reward 1.0), b 0.2 (0.5), c 0.5 (0.4): the one success outscores both failures, AUC 1."""
    cb = ready(StubV0({"a": 0.8, "b": 0.2, "c": 0.5}), reward_range=(0.0, 1.0))
    m = one_step(cb, ["a", "b", "c"], [[1.0], [0.5], [0.4]])
    assert m["v05/prior_auc"] == 1.0


def test_a_value_model_is_asked_for_no_metrics():
    """The callback logs none of V0's own metrics, so it asks `ValueModel.predict` for none (with_metrics=False)."""

    class SpyValueModel(ValueModel):
        def __init__(self):
            self.asked = []

        def predict(self, prompts, context, *, with_metrics=True):
            self.asked.append(with_metrics)
            return torch.full((len(prompts),), 0.5), {}

    spy = SpyValueModel()
    cb = ready(spy)
    cb.on_rollout_plan(None, None, plan_for(["a", "b"]))
    assert spy.asked == [False]
