"""A reward model (issue 43): a sequence-classification model made in code (the tiny Qwen3 architecture with one
label), saved as a local HF folder, scores prompt + completion in batches; its settings are checked up front, and so
is what the folder holds (issue 61, class 6: a causal LM or a 2-label classifier is refused before any work)."""

import json
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(scope="module")
def wrong_folders(tmp_path_factory):
    """A causal LM, a 2-label classifier, and a causal LM's weights under a config that claims a 1-label head."""
    from transformers import Qwen3ForCausalLM, Qwen3ForSequenceClassification

    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), hidden_size=32, layers=1)
    two_labels = tiny_config(len(tokenizer), hidden_size=32, layers=1)
    two_labels.num_labels = 2
    folders = {}
    for name, model in (("causal", Qwen3ForCausalLM(config)),
                        ("two_labels", Qwen3ForSequenceClassification(two_labels)),
                        ("no_head", Qwen3ForCausalLM(config))):
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        folders[name] = path
    spec = json.loads((folders["no_head"] / "config.json").read_text())
    spec.update(architectures=["Qwen3ForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (folders["no_head"] / "config.json").write_text(json.dumps(spec))
    folders["no_weights"] = tmp_path_factory.mktemp("no_weights")
    (folders["no_weights"] / "config.json").write_text(json.dumps(spec))
    return folders


@pytest.mark.parametrize("name, found", [
    ("no_weights", "holds a config.json and no weights (no *.safetensors or *.bin); save the model with "
                   "save_pretrained"),
    ("causal", "holds Qwen3ForCausalLM (config.json architectures), not a sequence-classification model: its score "
               "head would be initialised at random"),
    ("two_labels", "holds Qwen3ForSequenceClassification with 2 labels (config.json id2label); a reward model has "
                   "one label"),
])
def test_a_folder_that_is_not_a_one_label_reward_model_is_refused_naming_what_it_holds(wrong_folders, name, found):
    path = str(wrong_folders[name])
    assert reward_problems("model", {"path": path}) == [f"reward.options.path={path!r} {found}" + (
        "; give a reward model saved from AutoModelForSequenceClassification with one label" if name == "causal"
        else ", whose logit is the score" if name == "two_labels" else "")]
    with pytest.raises(ValueError, match="holds "):
        build_reward_runner("model", {"path": path})


def test_weights_without_the_score_head_are_refused_when_they_load_not_scored_at_random(wrong_folders):
    path = str(wrong_folders["no_head"])
    runner = build_reward_runner("model", {"path": path, "device": "cpu"})  # the config alone looks right
    with pytest.raises(ValueError, match=r"the weights hold no score\.weight \(the score head of "
                                         r"Qwen3ForSequenceClassification\)"):
        runner(["1+1="], ["2"], [2])
    runner.close()


def test_truncated_weights_stop_the_run_in_one_line_not_every_batch(reward_model, tmp_path):
    import shutil

    path = tmp_path / "truncated"
    shutil.copytree(reward_model[0], path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    runner = build_reward_runner("model", {"path": str(path), "device": "cpu"})  # the config alone looks right
    with pytest.raises(ValueError, match=rf"reward\.options\.path='{path}': the reward model cannot be loaded "
                                         r"\(SafetensorError"):  # it was a failure of every call, counted, rc 0
        runner(["1+1="], ["2"], [2])
    runner.close()


def test_a_folder_without_a_tokenizer_is_refused_before_any_work(reward_model, tmp_path):
    import shutil

    path = tmp_path / "no_tokenizer"
    shutil.copytree(reward_model[0], path)
    for name in [n.name for n in path.iterdir() if n.name.startswith("tokenizer")]:
        (path / name).unlink()  # every call failed on an empty tokenization, counted, rc 0
    assert reward_problems("model", {"path": str(path)}) == [
        f"reward.options.path={str(path)!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json): every "
        "call would fail; save the tokenizer there too (tokenizer.save_pretrained)"]


def test_train_py_refuses_a_causal_lm_as_reward_model_before_any_work(wrong_folders, tmp_path):
    path = wrong_folders["causal"]
    done = subprocess.run([sys.executable, "train.py", "reward=model", f"reward.options.path={path}",
                           f"hydra.run.dir={tmp_path}"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "holds Qwen3ForCausalLM" in done.stderr + done.stdout, done.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()
