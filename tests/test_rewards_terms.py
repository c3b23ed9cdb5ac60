"""Weighted reward terms (issue 43): the sum, the rule for a term that fails, returns None or is malformed, the
per-term metrics, the built-in format and length terms, and the settings checked before any work."""

import pytest

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.rewards import build_reward_runner, reward_problems
from lit_rlvr.rewards.terms import FormatReward, LengthReward


def _terms(**terms):
    return build_reward_runner("terms", {"terms": terms, "timeout_s": 2})


def test_terms_sum_with_weights_and_log_each_term():
    runner = _terms(arithmetic={"weight": 1.0}, format={"weight": 0.5, "options": {"pattern": r"-?\d+",
                                                                                   "fullmatch": True}})
    batch = runner(["1+1="] * 3, ["2", "2 apples", "x"], [2, 2, 2])
    assert batch.scores.tolist() == pytest.approx([1.5, 1.0, -1.0])
    assert batch.malformed.tolist() == [False, False, True]  # the arithmetic term's own malformed
    assert batch.failures == 0
    metrics = runner.take_metrics()
    assert metrics["reward/arithmetic/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/format/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/format/failures"] == 0
    assert runner.take_metrics() == {}  # taken once per step
    runner.close()


def test_a_term_that_returns_none_is_left_out_and_none_from_all_is_malformed_counted():
    runner = build_reward_runner("terms", {"terms": [{"name": "digits", "reward": "tests.source_rewards:only_digits",
                                                      "weight": 2.0},
                                                     {"name": "none", "reward": "tests.source_rewards:never"}]})
    batch = runner(["p", "p"], ["12", "ab"], [None, None])
    assert batch.scores.tolist() == [2.0, -1.0]
    assert batch.malformed.tolist() == [False, True] and batch.failures == 1
    assert batch.failed.tolist() == [False, True]
    metrics = runner.take_metrics()
    assert metrics["reward/digits/mean"] == 2.0 / 2.0 and "reward/none/mean" not in metrics  # scored nothing
    runner.close()


@pytest.mark.parametrize("kind", ["raise", "str", "sleep"])
def test_a_failed_term_makes_the_completion_malformed_counted_once_and_per_term(kind):
    runner = build_reward_runner("terms", {"terms": {"k": {"reward": "tests.source_rewards:by_kind", "weight": 3.0},
                                                     "format": {"weight": 1.0, "options": {"count": None,
                                                                                           "pattern": "."}}},
                                           "timeout_s": 0.5})
    batch = runner(["p", "p"], [kind, "fine"], [None, None])
    assert batch.scores.tolist() == [-1.0, 2.5]  # not 1.0 from the format term alone
    assert batch.malformed.tolist() == [True, False] and batch.failures == 1
    metrics = runner.take_metrics()
    assert metrics["reward/k/failures"] == 1 and metrics["reward/k/mean"] == 0.5
    runner.close()


def test_a_malformed_term_result_counts_its_score_and_marks_the_completion():
    runner = build_reward_runner("terms", {"terms": {"k": {"reward": "tests.source_rewards:by_kind"}}})
    batch = runner(["p"], ["bad"], [None])
    assert batch.scores.tolist() == [-1.0] and batch.malformed.tolist() == [True] and batch.failures == 0
    runner.close()


def test_the_sum_is_held_to_the_score_bound():
    runner = build_reward_runner("terms", {"terms": {"arithmetic": {"weight": 1e7}}})
    batch = runner(["p"], ["2"], [2])
    assert batch.scores.tolist() == [-1.0] and batch.failures == 1
    runner.close()


def test_terms_under_process_isolation_use_their_own_runner():
    runner = build_reward_runner("terms", {"terms": {"arithmetic": {"options": {"isolation": "process",
                                                                                "workers": 1}},
                                                     "digits": {"reward": "tests.source_rewards:only_digits"}},
                                           "timeout_s": 60})
    try:
        batch = runner(["p", "p"], ["3", "x"], [3, 3])
        assert batch.scores.tolist() == [2.0, -1.0] and batch.malformed.tolist() == [False, True]
    finally:
        runner.close()


def test_format_term():
    boxed = FormatReward()
    assert boxed(None, r"so \boxed{4}", None) == 1.0
    assert boxed(None, r"\boxed{4} or \boxed{5}", None) == 0.0 and boxed(None, "4", None) == 0.0
    assert FormatReward(r"<answer>.*</answer>", fullmatch=True)(None, " <answer>4</answer> ", None) == 1.0


def test_length_term_is_dapo_soft_overlong_on_text():
    length = LengthReward(max_len=10, cache=4)
    assert [length(None, "x" * n, None) for n in (6, 8, 10, 30)] == pytest.approx([0.0, -0.5, -1.0, -1.0])
    assert LengthReward(max_len=3, cache=1, unit="words")(None, "a b c", None) == -1.0


@pytest.mark.parametrize("options, key", [
    ({"terms": {"arithmetic": {"weight": float("nan")}}}, "reward.options.terms.arithmetic.weight=nan"),
    ({"terms": {"arithmetic": {"wieght": 1}}}, "reward.options.terms.arithmetic.wieght is not a term key"),
    ({"terms": {"format": {"options": {"pattern": "("}}}}, "reward.options.terms.format.options.pattern='('"),
    ({"terms": {"length": {"options": {"cache": 5000}}}}, "reward.options.terms.length.options.cache=5000"),
    ({"terms": {"x": {"reward": "nope"}}}, "reward='nope' is not valid"),
    ({"terms": []}, "reward.options.terms=[] is not valid"),
    ({"terms": "math"}, "reward.options.terms='math' is not valid"),
    ({"terms": {"arithmetic": 1}, "max_concurrent": 0}, "reward.options.terms.arithmetic.options.max_concurrent=0"),
])
def test_bad_term_settings_are_one_line_naming_the_key_before_any_work(options, key):
    problems = reward_problems("terms", options)
    assert len(problems) == 1 and key in problems[0], problems
    with pytest.raises(ValueError):  # the runner's constructor refuses the same (RewardOptionError is one)
        build_reward_runner("terms", options).close()


def test_the_module_checks_reward_settings_before_the_model_loads(monkeypatch):
    import lit_rlvr.module as module

    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=r"reward.options.terms.format.options.pattern"):
        module.GRPOModule(reward="terms", reward_options={"terms": {"format": {"options": {"pattern": "("}}}})


def test_train_py_checks_reward_settings_before_any_work():
    from hydra import compose, initialize_config_module

    from lit_rlvr.app.config_check import check_config

    with initialize_config_module("lit_rlvr.conf", version_base="1.3"):
        bad = compose("config", overrides=["reward=arithmetic_format", "reward.options.terms.format.weight=inf"])
        unset = compose("config", overrides=["reward=terms"])
        chosen = compose("config", overrides=["reward=terms", "reward.options.terms={arithmetic: 1.0, format: 0.2}"])
    with pytest.raises(ConfigError, match=r"^reward.options.terms.format.weight=inf is not valid"):
        check_config(bad)
    with pytest.raises(ConfigError, match=r"^reward.options.terms=\?\?\? is not valid: expected a mapping"):
        check_config(unset)
    check_config(chosen)  # a mapping given on the command line replaces the unset one


def test_a_train_py_run_with_weighted_terms_logs_each_term(tmp_path):
    from tests.test_faults import Run

    # a 5-step warm-up of its own (cached): the reward's plumbing is under test, not the policy
    run = Run(tmp_path / "terms", "reward=arithmetic_format", "trainer.max_steps=2", "model.options.max_steps=5",
              "model.options.eval_every=5", "model.options.eval_problems=8")
    code, log = run.wait(timeout=600)
    assert code == 0, log[-2000:]
    rows = run.rows()
    assert rows and all(r["reward/arithmetic/mean"] and r["reward/format/mean"] for r in rows)
    assert all(float(r["reward/format/failures"]) == 0 for r in rows)
    assert run.summary()["reward_failures"] == 0
