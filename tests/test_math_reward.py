"""Math reward: hand-labelled (completion, gold) pairs, and bounded / isolated scoring in worker processes.

Decisions the cases pin down (see lit_rlvr.rewards.math): the last box counts (boxes are not joined);
without a box only anchored answers ("final answer is", "Answer:") count, anything else is malformed;
a box cut off by the length limit is malformed; percent answers match both 50 and 0.5.
"""

import os
import pickle
import threading
import time

import pytest
import torch

from lit_rlvr.rewards.base import RewardResult, RewardRunner
from lit_rlvr.rewards.workers import ProcessRewardRunner
from lit_rlvr.rewards.math import MathReward, last_boxed, math_reward

CORRECT, WRONG, MALFORMED = (1.0, False), (-1.0, False), (-1.0, True)
CASES = [
    # fractions
    ("So the answer is \\boxed{\\frac{3}{4}}.", "3/4", CORRECT),
    ("\\boxed{0.75}", "\\frac{3}{4}", CORRECT),
    ("\\boxed{3/4}", "0.75", CORRECT),
    ("\\boxed{\\frac{6}{8}}", "3/4", CORRECT),
    ("\\boxed{\\frac{3}{5}}", "3/4", WRONG),
    # LaTeX forms
    ("\\boxed{\\dfrac{1}{2}}", "0.5", CORRECT),
    ("\\boxed{\\tfrac{1}{2}}", "1/2", CORRECT),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", CORRECT),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt2}{2}", CORRECT),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", CORRECT),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", WRONG),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", CORRECT),
    ("\\boxed{2\\pi}", "\\pi", WRONG),
    # intervals
    ("\\boxed{(1, 2)}", "(1,2)", CORRECT),
    ("\\boxed{[1,2)}", "[1,2)", CORRECT),
    ("\\boxed{[1,2]}", "[1,2)", WRONG),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", CORRECT),
    # golds with an escaped dollar sign (MATH-500 writes money so): a dollar sign, not math mode
    ("\\boxed{32348}", "\\$32,\\!348", CORRECT),
    ("\\boxed{\\$18.90}", "\\$18.90", CORRECT),
    ("\\boxed{37}", "\\$36", WRONG),
    # units
    ("\\boxed{5\\text{ cm}}", "5", CORRECT),
    ("\\boxed{5 \\text{cm}^2}", "5", CORRECT),
    ("\\boxed{\\$5}", "5", CORRECT),
    ("\\boxed{90^\\circ}", "90", CORRECT),
    ("\\boxed{6\\text{ cm}}", "5", WRONG),
    # percentages
    ("\\boxed{50\\%}", "50", CORRECT),
    ("\\boxed{50\\%}", "0.5", CORRECT),
    ("\\boxed{50}", "50\\%", CORRECT),
    ("\\boxed{40\\%}", "50\\%", WRONG),
    # several boxes: the last one counts
    ("First \\boxed{1}. Wait, I mis-added; redoing it gives \\boxed{2}", "2", CORRECT),
    ("First \\boxed{1}. Wait, I mis-added; redoing it gives \\boxed{2}", "1", WRONG),
    ("\\boxed{1} \\boxed{2}", "1, 2", WRONG),
    ("\\boxed{7} so again \\boxed{7}", "7", CORRECT),
    # no box: anchored answers only, else malformed
    ("The final answer is $7$.", "7", CORRECT),
    ("Answer: 12", "12", CORRECT),
    ("I think it is 7", "7", MALFORMED),
    ("", "7", MALFORMED),
    ("\\boxed{}", "3", MALFORMED),
    ("so \\boxed{\\frac{1}{2}", "1/2", MALFORMED),  # cut at the length limit
    # negative numbers
    ("\\boxed{-3}", "-3", CORRECT),
    ("\\boxed{3}", "-3", WRONG),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", CORRECT),
    # sets and tuples
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", CORRECT),
    ("\\boxed{2, 1}", "1, 2", CORRECT),
    ("\\boxed{(2, 1)}", "(1, 2)", WRONG),
    ("\\boxed{(1, 2, 3)}", "(1,2,3)", CORRECT),
    ("\\boxed{\\{1, 2, 3\\}}", "\\{1, 2\\}", WRONG),
    # gold answer formats
    ("\\boxed{3}", "$3$", CORRECT),
    ("\\boxed{3}", "The answer is \\boxed{3}.", CORRECT),
    ("\\boxed{3}", 3, CORRECT),
    ("\\boxed{0.5}", 0.5, CORRECT),
    ("\\boxed{1,000}", "1000", CORRECT),
    ("$\\boxed{3}$", "3", CORRECT),
    ("\\fbox{4}", "4", CORRECT),
    # equations and text answers
    ("\\boxed{x = 3}", "3", CORRECT),
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", CORRECT),
    ("\\boxed{\\text{Tuesday}}", "\\text{Monday}", WRONG),
]


POWER_TOWER = "So the answer is \\boxed{9^{9^{9^{9^{9}}}}}"


@pytest.mark.parametrize("completion,gold,expected", CASES)
def test_hand_labelled(completion, gold, expected):
    result = math_reward("prompt", completion, gold)
    assert (result.score, result.malformed) == expected, result.info


def test_enough_labelled_cases():
    assert len(CASES) >= 40


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{\\frac{1}{2}") == ""  # never closed


def test_format_weight():
    one, two, none = "\\boxed{3}", "\\boxed{2} then \\boxed{3}", "Answer: 3"
    assert MathReward()("", two, "3").score == 1.0  # off by default: rewards stay in {-1, +1}
    reward = MathReward(format_weight=0.1)
    assert reward("", one, "3").score == pytest.approx(1.1)
    assert reward("", two, "3").score == pytest.approx(0.9)
    assert reward("", none, "3").score == pytest.approx(0.9)
    assert reward("", "\\boxed{4}", "3").score == pytest.approx(-0.9)
    assert reward("", "nothing", "3").score == pytest.approx(-1.1)
    with pytest.raises(ValueError, match="timeout_s"):
        MathReward(timeout_s=-1)


def test_picklable_for_worker_pools():
    reward = pickle.loads(pickle.dumps(MathReward(format_weight=0.5)))
    assert reward.format_weight == 0.5 and pickle.loads(pickle.dumps(math_reward)) is math_reward


def test_runs_in_a_thread_without_signal_errors():
    # math-verify's timeouts use signal.alarm; off the main thread they must be switched off, not raise.
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=math_reward("", "\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(timeout=30)
    assert out["r"].score == 1.0


def test_in_process_runner_matches():
    completions, golds, expected = zip(*[(c, g, e) for c, g, e in CASES[:10]])
    batch = RewardRunner(math_reward)(["p"] * 10, completions, golds)
    assert batch.scores.tolist() == [e[0] for e in expected] and batch.failures == 0


# ------------------------------------------------------------------------------------------------------
# Worker processes. Rewards used there must be module-level (picklable).


def flaky_reward(prompt, completion, answer):
    if completion == "crash":
        os._exit(1)
    if completion == "hang":
        time.sleep(600)
    if completion == "raise":
        raise ValueError("boom")
    return RewardResult(1.0 if completion == str(answer) else -1.0, False, "")


@pytest.fixture(scope="module")
def math_runner():
    # math-verify's own timeout off: the power tower must be stopped by the runner's hard timeout
    runner = ProcessRewardRunner(MathReward(timeout_s=0), timeout_s=2.0, workers=2)
    runner(["p"], ["\\boxed{1}"], ["1"])  # start the workers outside the timed parts
    yield runner
    runner.close()


def test_process_runner_matches_in_process(math_runner):
    completions, golds, expected = zip(*CASES)
    batch = math_runner(["p"] * len(CASES), completions, golds)
    assert batch.scores.tolist() == [e[0] for e in expected]
    assert batch.malformed.tolist() == [e[1] for e in expected]
    assert batch.failures == 0


def test_pathological_expression_is_malformed_within_the_bound(math_runner):
    completions = ["\\boxed{3}", POWER_TOWER, "\\boxed{4}", "\\boxed{3}", "\\boxed{\\frac{6}{2}}"]
    start = time.monotonic()
    batch = math_runner(["p"] * 5, completions, ["3"] * 5)
    elapsed = time.monotonic() - start
    assert batch.scores.tolist() == [1.0, -1.0, -1.0, 1.0, 1.0]
    assert batch.malformed.tolist() == [False, True, False, False, False]
    assert batch.failures == 1
    assert elapsed < math_runner.timeout_s + 4.0  # the timeout, plus a pool restart on a busy 2-core box
    assert math_runner(["p"], ["\\boxed{2}"], ["2"]).scores.tolist() == [1.0]  # the rebuilt pool works


def test_math_verify_timeout_in_worker_main_thread():
    # With math-verify's signal timeout on (worker main thread), the tower ends as malformed without a kill.
    with ProcessRewardRunner(MathReward(timeout_s=1), timeout_s=30.0, workers=1) as runner:
        batch = runner(["p", "p"], [POWER_TOWER, "\\boxed{3}"], ["3", "3"])
    assert batch.malformed.tolist() == [True, False] and batch.scores.tolist() == [-1.0, 1.0]
    assert batch.failures == 0


@pytest.fixture(scope="module")
def flaky_runner():
    runner = ProcessRewardRunner(flaky_reward, timeout_s=1.0, workers=2)
    yield runner
    runner.close()


def test_crashing_worker_is_counted_and_runner_keeps_working(flaky_runner):
    batch = flaky_runner(["p"] * 5, ["1", "crash", "3", "4", "x"], [1, 2, 3, 0, 5])
    assert batch.scores.tolist() == [1.0, -1.0, 1.0, -1.0, -1.0]
    assert batch.malformed.tolist() == [False, True, False, False, False]
    assert batch.failures == 1  # only the crashing call is blamed, not the one beside it
    batch = flaky_runner(["p"] * 3, ["1", "2", "3"], [1, 2, 0])
    assert batch.scores.tolist() == [1.0, 1.0, -1.0] and batch.failures == 0


def test_hang_crash_and_raise_in_one_batch(flaky_runner):
    flaky_runner(["p"], ["1"], [1])  # warm
    start = time.monotonic()
    batch = flaky_runner(["p"] * 6, ["1", "hang", "crash", "raise", "5", "6"], [1, 2, 3, 4, 5, 0])
    elapsed = time.monotonic() - start
    assert batch.scores.tolist() == [1.0, -1.0, -1.0, -1.0, 1.0, -1.0]
    assert batch.malformed.tolist() == [False, True, True, True, False, False]
    assert batch.failures == 3
    assert elapsed < flaky_runner.timeout_s + 8.0  # one timeout, plus pool restarts


def test_empty_batch_and_validation():
    runner = ProcessRewardRunner(flaky_reward)
    batch = runner([], [], [])
    assert batch.scores.shape == (0,) and batch.failures == 0
    runner.close()
    with pytest.raises(TypeError, match="pickled"):
        ProcessRewardRunner(lambda p, c, a: RewardResult(1.0, False))
    with pytest.raises(ValueError, match="timeout_s"):
        ProcessRewardRunner(flaky_reward, timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        ProcessRewardRunner(flaky_reward, workers=0)


def test_scores_are_tensors(flaky_runner):
    batch = flaky_runner(["p", "p"], ["1", "2"], [1, 1])
    assert batch.scores.dtype == torch.float32 and batch.malformed.dtype == torch.bool


def test_reward_options_that_would_be_dropped_or_crash_say_which_key():
    from lit_rlvr.rewards import build_reward_runner

    with pytest.raises(ValueError, match=r"reward='arithmetic' is a function and takes no options.*\['typo'\]"):
        build_reward_runner("arithmetic", {"typo": 1})
    with pytest.raises(ValueError, match=r"^reward\.options\.workers=2 sets the worker processes of "
                                         r"reward\.options\.isolation=process.*reward='math' runs in the training"):
        build_reward_runner("math", {"workers": 2})  # workers belongs to isolation=process
    assert build_reward_runner("math", {"timeout_s": 2.0, "format_weight": 0.1}).fn.format_weight == 0.1


def test_a_non_finite_score_is_a_counted_failure():
    """A NaN score would reach the advantages (and V0.5's context): it is scored like a raising reward."""
    scores = iter([float("nan"), 1.0, None])
    runner = RewardRunner(lambda p, c, a: RewardResult(next(scores), False, ""))
    batch = runner(["p"] * 3, ["c"] * 3, [0] * 3)
    assert batch.scores.tolist() == [-1.0, 1.0, -1.0] and batch.malformed.tolist() == [True, False, True]
    assert batch.failures == 2
