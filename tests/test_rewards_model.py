"""A reward model (issue 43): a sequence-classification model made in code (the tiny Qwen3 architecture with one
label), saved as a local HF folder, scores prompt + completion in batches; its settings are checked up front."""

import pytest
import torch

from lit_rlvr.models.tiny import build_tokenizer, tiny_config
from lit_rlvr.rewards import build_reward_runner, reward_problems


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    from transformers import Qwen3ForSequenceClassification

    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), hidden_size=32, layers=1)
    config.num_labels = 1
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(config).eval()
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def test_reward_model_scores_are_its_logits_batched(reward_model):
    path, model, tokenizer = reward_model
    prompts, completions = ["1+1=", "2+2=", "3+3="], ["2", "5", "a longer completion"]
    runner = build_reward_runner("model", {"path": str(path), "batch_size": 2, "device": "cpu"})
    batch = runner(prompts, completions, [2, 4, 6])
    runner.close()
    with torch.no_grad():
        want = [model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0].item()
                for p, c in zip(prompts, completions)]
    assert batch.scores.tolist() == pytest.approx(want, abs=1e-4)  # padded batches vs one at a time: rounding
    assert not batch.malformed.any() and batch.failures == 0


def test_reward_model_as_a_weighted_term(reward_model):
    path, _, _ = reward_model
    runner = build_reward_runner("terms", {"terms": {"arithmetic": 1.0, "rm": {"reward": "model", "weight": 0.0,
                                                                               "options": {"path": str(path)}}}})
    batch = runner(["1+1="], ["2"], [2])
    metrics = runner.take_metrics()
    runner.close()
    assert batch.scores.tolist() == [1.0] and "reward/rm/mean" in metrics


@pytest.mark.parametrize("options, line", [
    ({}, "reward=model needs reward.options.path"),
    ({"path": "/nonexistent/rm"}, "reward.options.path='/nonexistent/rm' is not valid"),
    ({"path": "PATH", "dtype": "fp8"}, "reward.options.dtype='fp8' is not valid"),
    ({"path": "PATH", "batch_size": 0}, "reward.options.batch_size=0 is not valid"),
])
def test_reward_model_settings_one_line_each(reward_model, options, line):
    options = {k: str(reward_model[0]) if v == "PATH" else v for k, v in options.items()}
    problems = reward_problems("model", options)
    assert len(problems) == 1 and problems[0].startswith(line), problems
