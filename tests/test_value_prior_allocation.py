"""V0.5's allocation rules at equal mean rollouts (`ValuePrior(allocation=...)`, lit_rlvr/algorithms/allocation.py):
uniform and Beta-posterior allocation spend exactly `mean_rollouts` per prompt whatever the data, Beta puts more where
the predicted variance is larger and learns from a prompt's history, the history survives a state round trip, and
the settings are checked."""

import pytest

from lit_rlvr.callbacks import ValuePrior
from test_value_prior_callback import MetricSink, StubV0, fake_rollouts, plan_for


def _run_step(cb, prompts, first_round, more):
    """One step through the callback: plan, first round `first_round` (per-prompt rewards), the budget rule, then an
    extra round whose rewards per prompt are `more(b, n)`; returns the per-prompt counts."""
    plan = plan_for(prompts)
    cb.on_rollout_plan(None, MetricSink(), plan)
    assert plan.n_per_prompt == [cb.k_init] * len(prompts)
    rollouts = fake_rollouts(prompts, first_round)
    extra = plan.budget_rule(rollouts) or [0] * len(prompts)
    rewards = [r + more(b, n) for b, (r, n) in enumerate(zip(first_round, extra))]
    final = fake_rollouts(prompts, rewards)
    assert plan.budget_rule(final) is None  # one extra round only
    cb.on_before_advantages(None, MetricSink(), final)
    cb.on_rl_step_end(None, MetricSink(), final)
    return [len(r) for r in rewards]


FIRST_ROUNDS = [
    [[1, 1, 1, 1], [-1, -1, -1, -1], [1, -1, 1, -1], [1, -1, -1, -1]],
    [[1, 1, 1, -1], [1, 1, 1, 1], [1, 1, 1, 1], [-1, -1, -1, -1]],
]


@pytest.mark.parametrize("rule", ["uniform", "beta"])
@pytest.mark.parametrize("first", FIRST_ROUNDS)
def test_fixed_rules_spend_mean_rollouts(rule, first):
    cb = ValuePrior(value_model=StubV0({}), min_context=1, context_size=8, k_init=4, k_max=16, allocation=rule,
                    mean_rollouts=9)
    counts = _run_step(cb, ["a", "b", "c", "d"], [list(map(float, r)) for r in first],
                       lambda b, n: [1.0] * n)
    assert sum(counts) / len(counts) == 9  # the same mean rollouts per prompt for every rule and every batch
    assert all(4 <= c <= 16 for c in counts)
    if rule == "uniform":
        assert counts == [9, 9, 9, 9]


def test_beta_follows_variance_and_history():
    cb = ValuePrior(value_model=StubV0({}), min_context=1, context_size=8, k_init=4, k_max=16, allocation="beta",
                    mean_rollouts=8)
    half = [1.0, -1.0, 1.0, -1.0]
    counts = _run_step(cb, ["mixed", "solved"], [half, [1.0] * 4], lambda b, n: [1.0] * n)
    assert counts[0] > counts[1] and sum(counts) == 16  # p̂ = 1/2 against 5/6: more samples for the mixed one
    # the history: "solved" keeps succeeding, so the next time its posterior is surer and it gets fewer still
    again = _run_step(cb, ["mixed", "solved"], [half, [1.0] * 4], lambda b, n: [1.0] * n)
    assert again[1] < counts[1]
    state = cb.state_dict()
    fresh = ValuePrior(value_model=StubV0({}), min_context=1, context_size=8, k_init=4, k_max=16, allocation="beta",
                       mean_rollouts=8)
    fresh.load_state_dict(state)
    assert fresh._budget.records == cb._budget.records and "solved" in fresh._budget.records


def test_osla_unchanged_by_default():
    cb = ValuePrior(value_model=StubV0({}), min_context=1, context_size=8, k_init=4)
    assert cb.allocation == "osla" and "allocation" not in cb.state_dict()


@pytest.mark.parametrize("kwargs, match", [
    (dict(allocation="neyman"), "allocation='neyman' is not valid"),
    (dict(allocation="uniform"), "mean_rollouts=None with .*allocation=uniform"),
    (dict(mean_rollouts=8), "mean_rollouts=8 with .*allocation=osla"),
    (dict(allocation="beta", mean_rollouts=2), r"mean_rollouts=2 must be in \[k_init, k_max\]"),
    (dict(allocation="beta", mean_rollouts=20), r"mean_rollouts=20 must be in"),
    (dict(allocation="beta", mean_rollouts="8"), "must be a number"),
    (dict(allocation="beta", mean_rollouts=float("nan")), "mean_rollouts"),
])
def test_settings_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ValuePrior(value_model=StubV0({}), k_init=4, k_max=16, **kwargs)
