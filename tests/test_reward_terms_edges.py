"""Reward terms at their edges: the length term at each bound of its ramp, the format term's counts, the forms a
term list may take (and the lines that refuse the others), shared runner options, and the per-term metrics of a
batch where terms skip, fail and score."""

from __future__ import annotations

import pytest
import torch

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.rewards.base import RewardBatch
from lit_rlvr.rewards.terms import FormatReward, LengthReward, Term, TermsRunner, build_terms, term_specs


@pytest.mark.parametrize("n, expected", [(0, 0.0), (5, 0.0), (6, 0.0), (7, -0.25), (9, -0.75), (10, -1.0),
                                         (11, -1.0)])
def test_the_length_ramp_at_each_bound(n, expected):
    assert LengthReward(max_len=10, cache=4)(None, "x" * n, None) == pytest.approx(expected)


def test_length_defaults_are_1024_characters_with_the_last_256_a_ramp():
    default = LengthReward()
    assert [default(None, "x" * n, None) for n in (768, 769, 896, 1023, 1024, 5000)] == pytest.approx(
        [0.0, -1 / 256, -0.5, -255 / 256, -1.0, -1.0])


def test_length_in_words_and_a_cache_of_zero_or_the_whole_budget():
    words = LengthReward(max_len=4, cache=2, unit="words")
    assert [words(None, " ".join("w" * i for i in range(1, k + 1)), None) for k in (2, 3, 4)] == [0.0, -0.5, -1.0]
    assert [LengthReward(max_len=3, cache=0)(None, "x" * n, None) for n in (3, 4)] == [0.0, -1.0]
    whole = LengthReward(max_len=4, cache=4)
    assert [whole(None, "x" * n, None) for n in (0, 1, 4)] == [0.0, -0.25, -1.0]


@pytest.mark.parametrize("options, key", [({"max_len": 0}, "max_len"), ({"max_len": True}, "max_len"),
                                          ({"max_len": 4, "cache": 5}, "cache"), ({"cache": -1}, "cache"),
                                          ({"unit": "tokens"}, "unit"), ({"max_len": 1.5}, "max_len")])
def test_length_options_refused(options, key):
    with pytest.raises(RewardOptionError, match=rf"reward\.options\.{key}="):
        LengthReward(**options)
    LengthReward(max_len=1, cache=1)  # the smallest valid


def test_format_counts():
    assert FormatReward(pattern="a", count=0)(None, "bbb", None) == 1.0
    assert FormatReward(pattern="a", count=0)(None, "bab", None) == 0.0
    assert FormatReward(pattern="a", count=2)(None, "aba", None) == 1.0
    assert FormatReward(pattern="a", count=None)(None, "b", None) == 0.0
    assert FormatReward(pattern="a", count=None)(None, "aaa", None) == 1.0
    assert FormatReward(pattern="a", count=None)(None, "bab", None) == 1.0  # at least once: once is enough
    assert FormatReward(pattern="a+", fullmatch=True)(None, " aa\n", None) == 1.0
    assert FormatReward(pattern="a", fullmatch=True)(None, "aa", None) == 0.0
    for bad in (-1, True, 1.0):
        with pytest.raises(RewardOptionError, match="reward.options.count"):
            FormatReward(count=bad)


def test_the_forms_of_a_term_list():
    specs, problems = term_specs({"a": None, "b": 2, "c": {"reward": "math", "weight": 0.5, "options": {"x": 1}}})
    assert problems == [] and specs == [("a", "a", 1.0, {}), ("b", "b", 2, {}), ("c", "math", 0.5, {"x": 1})]
    specs, problems = term_specs(["a", {"name": "b", "weight": 3}])
    assert problems == [] and specs == [("a", "a", 1.0, {}), ("b", "b", 3, {})]


@pytest.mark.parametrize("value, line", [
    ([5], "reward.options.terms[0]=5"), ([{"weight": 1}], "reward.options.terms[0]="),
    (["a", "a"], "reward.options.terms.a: two terms named 'a'"),
    ({"a": "x"}, "reward.options.terms.a='x'"), ({"a": {"options": [1]}}, "reward.options.terms.a.options=[1]"),
    ({"a": {"reward": "terms"}}, "reward.options.terms.a.reward='terms'"),
    ({"a": {"weight": float("inf")}}, "reward.options.terms.a.weight=inf"),
    ({"a": {"weight": "1"}}, "reward.options.terms.a.weight='1'"), ({}, "reward.options.terms={}"),
    (None, "reward.options.terms=None")])
def test_term_lists_refused_one_line_each(value, line):
    specs, problems = term_specs(value)
    assert len(problems) == 1 and problems[0].startswith(line), problems


def test_every_bad_term_is_named_not_only_the_first():
    """One line per bad entry: an entry refused for any reason does not hide the entries after it."""
    specs, problems = term_specs({"a": "x", "b": {"colour": 1}, "c": {"options": [1]}, "d": {"reward": "terms"},
                                  "e": {"weight": "1"}, "f": 2.0})
    assert [line.split("=")[0].split(" ")[0] for line in problems] == [
        "reward.options.terms.a", "reward.options.terms.b.colour", "reward.options.terms.c.options",
        "reward.options.terms.d.reward", "reward.options.terms.e.weight"]
    assert specs[-1] == ("f", "f", 2.0, {})
    _, problems = term_specs(["a", "a", {"name": "b", "weight": "x"}])
    assert len(problems) == 2 and "two terms named 'a'" in problems[0] and "terms.b.weight" in problems[1]


class Fixed:
    """A term runner returning fixed scores, skips and failures."""

    def __init__(self, scores, skipped=None, failed=None, malformed=None):
        n = len(scores)
        self.batch = RewardBatch(scores=torch.tensor(scores, dtype=torch.float32),
                                 malformed=torch.tensor(malformed or [False] * n),
                                 failed=torch.tensor(failed or [False] * n),
                                 skipped=torch.tensor(skipped or [False] * n), failures=sum(failed or []))
        self.stop_reason, self.closed, self.options = None, False, None
        self.contract = type("C", (), {"none_skips": False})()

    def __call__(self, prompts, completions, answers):
        return self.batch

    def close(self):
        self.closed = True


def test_shared_options_reach_every_term_and_the_cap_only_those_that_take_it():
    built = {}

    def build(reward, options):
        built[reward] = options
        return Fixed([0.0])

    runner = build_terms({"terms": {"a": {"options": {"timeout_s": 9}}, "b": {}}, "timeout_s": 3, "max_concurrent": 2},
                         build, takes_cap=lambda reward: reward == "b")
    assert built == {"a": {"timeout_s": 9}, "b": {"timeout_s": 3, "max_concurrent": 2}}
    assert all(t.runner.contract.none_skips for t in runner.terms)  # None skips a term's completion
    assert [(t.name, t.weight) for t in runner.terms] == [("a", 1.0), ("b", 1.0)]
    runner.close()
    assert all(t.runner.closed for t in runner.terms)
    built.clear()
    build_terms({"terms": {"a": {}, "b": {}}, "max_concurrent": 2}, build)  # no rule given: every term takes it
    assert built == {"a": {"max_concurrent": 2}, "b": {"max_concurrent": 2}}
    for bad, line in [({"terms": {"a": {}}, "max_concurrent": 0}, "reward.options.max_concurrent=0"),
                      ({"terms": {"a": {}}, "bogus": 1}, "reward.options.bogus is not an option of reward=terms")]:
        with pytest.raises(RewardOptionError, match=line):
            build_terms(bad, build)


def test_terms_built_before_a_failing_one_are_closed():
    made = []

    def build(reward, options):
        if reward == "bad":
            raise RewardOptionError(["reward=bad"])
        made.append(Fixed([0.0]))
        return made[-1]

    with pytest.raises(RewardOptionError):
        build_terms({"terms": ["a", "bad"]}, build)
    assert [m.closed for m in made] == [True]


def test_the_sum_skips_failures_and_per_term_metrics():
    a = Fixed([1.0, 2.0, 3.0, 4.0], skipped=[False, True, False, True], malformed=[False, False, True, False])
    b = Fixed([10.0, 20.0, 30.0, 40.0], failed=[False, False, False, True], skipped=[False, True, False, False])
    runner = TermsRunner([Term("a", 2.0, a), Term("b", 0.5, b)])
    out = runner(["p"] * 4, ["c"] * 4, [None] * 4)
    # row 0: 2·1 + 0.5·10; row 1: skipped by both → malformed, counted; row 2: malformed by a; row 3: b failed
    assert out.scores.tolist() == [7.0, -1.0, 21.0, -1.0]
    assert out.malformed.tolist() == [False, True, True, True] and out.failures == 2
    assert runner.take_metrics() == {"reward/a/mean": 2.0, "reward/a/failures": 0.0, "reward/b/mean": 20.0,
                                     "reward/b/failures": 1.0}
    runner(["p"] * 4, ["c"] * 4, [None] * 4)
    runner(["p"] * 4, ["c"] * 4, [None] * 4)
    assert runner.take_metrics()["reward/b/failures"] == 2.0  # summed over calls since the last take
    assert runner.stop_reason is None
    b.stop_reason = "b stopped"
    assert runner.stop_reason == "b stopped"
