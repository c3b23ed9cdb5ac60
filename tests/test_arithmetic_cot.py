"""The built-in chain-of-thought task `arithmetic_cot`: problems, written working, reward, levels, config."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.data.tasks.arithmetic_cot import (
    LEVELS,
    ArithmeticCoTTask,
    arithmetic_cot_reward,
    check_working,
    read_answer,
    reference_completion,
)
from lit_rlvr.models.tiny import build_tokenizer
from lit_rlvr.rewards import build_reward_runner

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_problems_are_a_function_of_the_seed_and_the_splits_never_overlap():
    task = ArithmeticCoTTask(levels=tuple(LEVELS), seed=3)
    assert task.problems(50) == ArithmeticCoTTask(levels=tuple(LEVELS), seed=3).problems(50)
    assert task.problems(50) != ArithmeticCoTTask(levels=tuple(LEVELS), seed=4).problems(50)
    train = {p["prompt"] for p in task.problems(400)}
    test = {p["prompt"] for p in task.problems(400, "test")}
    assert not train & test


def test_hand_worked_workings():
    assert reference_completion("347+589") == "7+9+0=16\n4+8+1=13\n3+5+1=9\nAnswer: 936"
    assert reference_completion("52-17") == "12-7-0=5\n5-1-1=3\nAnswer: 35"
    assert reference_completion("47*36") == ("47*6: 7*6+0=42 4*6+4=28 -> 282\n47*3: 7*3+0=21 4*3+2=14 -> 141\n"
                                             "282+1410:\n2+0+0=2\n8+1+0=9\n2+4+0=6\n0+1+0=1\n-> 1692\nAnswer: 1692")
    assert reference_completion("95+17").endswith("Answer: 112")  # the last carry becomes the leading digit
    assert reference_completion("100-1") == "10-1-0=9\n10-0-1=9\n1-0-1=0\nAnswer: 99"  # a borrow through a 0


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_written_step_is_right_and_the_answer_is_the_result(level):
    for p in ArithmeticCoTTask(levels=(level,)).problems(200):
        a, op, b = p["prompt"].rstrip("=").partition(next(c for c in "+-*" if c in p["prompt"]))
        assert p["answer"] == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert check_working(p["target"]) == []
        assert read_answer(p["target"]) == p["answer"]
        assert arithmetic_cot_reward(p["prompt"], p["target"], p["answer"]).score == 1.0


def test_the_checker_finds_a_wrong_step():
    good = reference_completion("347+589")
    assert check_working(good.replace("4+8+1=13", "4+8+1=14")) == ["4+8+1=14 (is 13)"]
    assert check_working(reference_completion("47*36").replace("4*6+4=28", "4*6+4=26")) == ["4*6+4=26 (is 28)"]
    assert check_working("7+9+0=16") == ["no final answer"]


@pytest.mark.parametrize("completion, score, malformed", [
    ("7+9+0=16\nAnswer: 936", 1.0, False),
    ("Answer: 936\n", 1.0, False),  # trailing whitespace is fine
    ("Answer: 935", -1.0, False),
    ("7+9+0=16\n4+8+1=13", -1.0, True),  # truncated: no marked answer
    ("Answer: 936 because", -1.0, True),  # text after the answer
    ("Answer: 935\nAnswer: 936", -1.0, True),  # two answers: no hedging
    ("Answer: x", -1.0, True),
    ("936", -1.0, True),  # unmarked
])
def test_reward_reads_only_the_marked_final_answer(completion, score, malformed):
    result = arithmetic_cot_reward("347+589=", completion, 936)
    assert (result.score, result.malformed) == (score, malformed)


def test_reward_is_built_in_by_name():
    runner = build_reward_runner("arithmetic_cot")
    scored = runner(["1+1="], ["1+1+0=2\nAnswer: 2"], [2])
    assert scored.scores.tolist() == [1.0] and not bool(scored.malformed.any())


def test_levels_span_30_to_200_tokens_of_the_tiny_model():
    tokenizer = build_tokenizer()

    def mean_tokens(level: int) -> float:
        problems = ArithmeticCoTTask(levels=(level,)).problems(100)
        return sum(len(tokenizer(p["target"])["input_ids"]) + 1 for p in problems) / len(problems)  # + eos

    means = {level: mean_tokens(level) for level in LEVELS}
    assert 25 <= means[1] <= 35 and 170 <= means[max(LEVELS)] <= 210
    assert means[7] < means[8] < means[9]
    assert all(len(tokenizer(p["prompt"] + p["target"])["input_ids"]) < 256  # the tiny model's context
               for p in ArithmeticCoTTask(levels=tuple(LEVELS)).problems(300))


@pytest.mark.parametrize("kwargs, message", [
    (dict(levels=(0,)), r"data.levels=\[0\] is not valid for data.task=arithmetic_cot; choose from \[1, 2"),
    (dict(levels=()), r"data.levels=\[\] is not valid"),
    (dict(test_fraction=1.5), r"data.test_fraction must be in \(0, 1\), got 1.5"),
])
def test_bad_values_give_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        ArithmeticCoTTask(**kwargs)
    assert "\n" not in str(info.value)


def test_datamodule_serves_the_task_and_refuses_unknown_tasks():
    data = RLVRDataModule(task="arithmetic_cot", levels=(1, 7), batch_size=4, num_train=20, num_test=8)
    data.setup("fit")
    row = data.train_set[0]
    assert row["prompt"].endswith("=") and isinstance(row["answer"], int) and row["level"] in (1, 7)
    with pytest.raises(ValueError, match="data.task='cot' is not valid; valid: arithmetic, arithmetic_cot"):
        RLVRDataModule(task="cot")


def test_data_config_picks_its_reward_model_and_completion_budget():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["data=arithmetic_cot"])
        mine = compose("config", overrides=["data=arithmetic_cot", "algorithm=c3po", "algorithm.max_new_tokens=200",
                                            "reward=arithmetic", "model=qwen3_4b", "trainer.max_steps=7"])
        default = compose("config")
    assert (cfg.data.task, cfg.reward.name, cfg.model.options.task) == ("arithmetic_cot", "arithmetic_cot",
                                                                          "arithmetic_cot")
    assert cfg.algorithm.max_new_tokens == cfg.task_max_new_tokens == 64
    assert list(cfg.model.options.levels) == list(cfg.data.levels)  # warmed up on the levels it trains on
    assert (mine.algorithm.max_new_tokens, mine.reward.name, mine.model.name_or_path) == (
        200, "arithmetic", "Qwen/Qwen3-4B-Instruct-2507")  # the command line wins
    assert default.algorithm.max_new_tokens == 8 and default.reward.name == "arithmetic"
    # the task's CPU step count (a run that gains in minutes), the default's 250 elsewhere; the command line wins
    assert (cfg.trainer.max_steps, default.trainer.max_steps, mine.trainer.max_steps) == (50, 250, 7)
    # token-budget micro-batches for its 30-200-token completions; off at the default task
    assert (cfg.algorithm.micro_batch_tokens, mine.algorithm.micro_batch_tokens) == (2048, 2048)
    assert default.algorithm.micro_batch_tokens is None


@pytest.mark.parametrize("algorithm", sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml")))
def test_every_algorithm_takes_the_task(algorithm):
    from lit_rlvr.app.config_check import check_config

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["data=arithmetic_cot", f"algorithm={algorithm}"])
    check_config(cfg)
    assert cfg.algorithm.max_new_tokens == 64 and cfg.reward.name == "arithmetic_cot"
    assert cfg.algorithm.micro_batch_tokens == 2048
