"""The tiny model's cached warm-up (lit_rlvr.rollout.warmup)."""

import json

import pytest
import torch

from lit_rlvr.data.tasks.arithmetic import ArithmeticTask
from lit_rlvr.rollout import warmup
from lit_rlvr.rollout.warmup import warm_start_tiny

QUICK = dict(max_steps=2, batch_size=4, eval_every=1, eval_problems=4, target=1.0)  # stops at the cap


def test_warm_up_leaves_the_callers_rng_alone(tmp_path):
    """A cold cache trains the model; the caller's random numbers must not depend on whether it did."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match="step cap"):
        path = warm_start_tiny(tmp_path, **QUICK)
    assert torch.equal(torch.get_rng_state(), before)
    assert (path / "config.json").exists() and not list(tmp_path.glob("*.tmp-*"))
    assert warm_start_tiny(tmp_path, **QUICK) == path  # warm: the same folder, nothing trained


def _warm_up_slowly(cache: str, marks: str) -> str:
    """A rank's warm-up on a cold cache; each training leaves a mark, and takes long enough to overlap."""
    import os
    import time
    from pathlib import Path

    from lit_rlvr.rollout import warmup

    train = warmup._train

    def marked_train(*args, **kwargs):
        (Path(marks) / str(os.getpid())).touch()
        time.sleep(1.0)
        return train(*args, **kwargs)

    warmup._train = marked_train
    return str(warmup.warm_start_tiny(cache, max_steps=2, batch_size=4, eval_every=1, eval_problems=4, target=1.0))


def test_ranks_warming_up_at_once_train_once(tmp_path):
    """Two processes ask for the same cold cache entry together: one trains, the other waits and loads it."""
    import multiprocessing

    marks = tmp_path / "marks"
    marks.mkdir()
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.starmap(_warm_up_slowly, [(str(tmp_path / "cache"), str(marks))] * 2)
    assert paths[0] == paths[1]
    assert len(list(marks.iterdir())) == 1


def _scripted(monkeypatch, accuracies: list[float]) -> list[int]:
    """Checks return `accuracies` in turn (the training itself is real); returns the torch thread count each
    check ran with."""
    threads, left = [], iter(accuracies)

    def fake(model, tokenizer, problems, samples, seed=0, **options):
        threads.append(torch.get_num_threads())
        return next(left)

    monkeypatch.setattr(warmup, "sampled_accuracy", fake)
    return threads


def test_warm_up_stops_at_the_first_check_that_reaches_the_target(tmp_path, monkeypatch):
    threads_in_checks = _scripted(monkeypatch, [0.1, 0.25, 0.31, 0.5])
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a caller with two threads: the warm-up still trains and checks on one
    try:
        path = warm_start_tiny(tmp_path, max_steps=100, eval_every=2, eval_problems=8, batch_size=4, target=0.3)
        assert torch.get_num_threads() == 2  # the caller's count is back
    finally:
        torch.set_num_threads(caller_threads)
    record = json.loads((path / "warmup.json").read_text())
    assert record["steps"] == 6 and record["reached"] and record["accuracy"] == 0.31
    assert [step for step, _ in record["history"]] == [2, 4, 6]
    assert record["target"] == 0.3 and record["threads"] == 1 and threads_in_checks == [1, 1, 1]
    assert record["kernels"] == warmup.kernel_family()


def test_warm_up_that_hits_its_cap_says_which_options_to_change(tmp_path, monkeypatch):
    _scripted(monkeypatch, [0.1, 0.2])
    with pytest.warns(UserWarning, match=r"model\.options\.max_steps=4.*0\.200.*model\.options\.target=0\.3"):
        path = warm_start_tiny(tmp_path, max_steps=4, eval_every=2, eval_problems=8, batch_size=4, target=0.3)
    record = json.loads((path / "warmup.json").read_text())
    assert record["steps"] == 4 and not record["reached"]


def test_the_target_is_part_of_the_cache_key(tmp_path, monkeypatch):
    _scripted(monkeypatch, [0.9, 0.9])
    low = warm_start_tiny(tmp_path, max_steps=4, eval_every=2, eval_problems=8, batch_size=4, target=0.3)
    high = warm_start_tiny(tmp_path, max_steps=4, eval_every=2, eval_problems=8, batch_size=4, target=0.4)
    assert low != high


def test_a_target_outside_0_1_names_the_option(tmp_path):
    with pytest.raises(ValueError, match=r"model\.options\.target=30"):
        warm_start_tiny(tmp_path, target=30)


def test_dev_problems_are_neither_trained_on_nor_in_rls_held_out_split():
    task = ArithmeticTask(levels=(2, 3, 4), seed=0)
    dev = {p["prompt"] for p in warmup.dev_problems(task, 256)}
    stream = warmup._training_problems(task)
    trained = {next(stream)["prompt"] for _ in range(20_000)}
    held_out = {p["prompt"] for p in task.problems(2000, "test")}  # RL's held-out problems (data.num_test of them)
    assert len(dev) > 200 and not dev & trained and not dev & held_out
    assert len(trained) > 5000  # the training stream still covers the train split's problem space


def test_an_unknown_tiny_option_names_it_and_the_valid_ones(tmp_path):
    from lit_rlvr.rollout.warmup import resolve_model_path

    with pytest.raises(ValueError, match=r"model\.options\.steps is not an option.*valid: target, max_steps"):
        resolve_model_path("tiny", {"cache_dir": str(tmp_path), "steps": 800})


def test_chain_of_thought_warm_up_trains_on_the_working_and_has_its_own_cache_entry(tmp_path, monkeypatch):
    """task=arithmetic_cot: the labels are the written working and the marked answer; the task and the target
    are in the cache key and in warmup.json; the checks score with the task's reward at its completion budget."""
    from lit_rlvr.data.tasks.arithmetic_cot import ArithmeticCoTTask, arithmetic_cot_reward
    from lit_rlvr.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    problem = ArithmeticCoTTask().problem(0)
    ids, _, labels = warmup.sft_batch(tokenizer, [problem])
    answer_part = labels[0][labels[0] != -100]
    assert tokenizer.decode(answer_part, skip_special_tokens=True) == problem["target"]
    seen = []
    monkeypatch.setattr(warmup, "sampled_accuracy",
                        lambda model, tok, problems, samples, seed=0, **options: seen.append(options) or 0.5)
    cot = dict(max_steps=4, batch_size=2, eval_every=2, eval_problems=2, levels=(1,), task="arithmetic_cot",
               max_new_tokens=40, hidden_size=32, layers=1)
    path = warm_start_tiny(tmp_path, target=0.4, **cot)
    record = json.loads((path / "warmup.json").read_text())
    assert (record["task"], record["target"], record["steps"]) == ("arithmetic_cot", 0.4, 2)
    assert seen == [{"reward": arithmetic_cot_reward, "max_new_tokens": 40}]
    assert warm_start_tiny(tmp_path, target=0.45, **cot) != path  # another target: another entry
    plain = {k: v for k, v in cot.items() if k not in ("task", "max_new_tokens")}
    assert warm_start_tiny(tmp_path, target=0.4, **plain) != path  # the default task: another entry
    with pytest.raises(ValueError, match="model.options.task='cot' is not valid; valid: arithmetic, arithmetic_cot"):
        warm_start_tiny(tmp_path, task="cot")
