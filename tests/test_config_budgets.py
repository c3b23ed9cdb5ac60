"""Every real-data preset composes a completion budget that fits its data and its model (issue 61, class 1: they
all composed 8 tokens), and a budget below what the data declares its completions need (`data.answer_tokens`) is
refused before any work, by train.py's config check and by the datamodule on every entry point. Composed with
Hydra only: nothing trains here."""

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from lit_rlvr.app.config_check import check_config
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.data.datamodule import RLVRDataModule

REPO = Path(__file__).resolve().parents[1]
# the positions of the preset models (their config.json's max_position_embeddings), known here without a download
CONTEXT = {"tiny": 256, "Qwen/Qwen3-4B-Instruct-2507": 262144, "Qwen/Qwen2.5-Math-7B": 4096}
PROMPT_ROOM = 512  # a preset's budget must leave at least this many positions for the prompt


def _compose(*overrides: str):
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _readme_block(heading: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text[text.index(heading):]
    block = block[block.index("```bash\n") + 8:]
    return shlex.split(block[: block.index("\n```")].replace("\\\n", " "))


def _fits(cfg, minimum: int) -> None:
    budget, context = cfg.algorithm.max_new_tokens, CONTEXT[cfg.model.name_or_path]
    assert budget >= minimum, budget
    assert budget + PROMPT_ROOM <= context, (budget, context)
    declared = cfg.data.get("answer_tokens")
    assert declared is None or budget >= declared, (budget, declared)


@pytest.mark.parametrize("overrides,minimum", [
    (["data=dapo_math", "model=qwen3_4b"], 8192),  # verl's DAPO recipe for 7B models
    (["algorithm=c3po_paper", "data=dapo_math", "model=qwen3_4b"], 8192),
    (["algorithm=dapo", "data=dapo_math", "model=qwen3_4b"], 8192),
    (["data=math500", "model=qwen25_math_7b"], 3000),  # Dr. GRPO's, within the model's 4096 positions
    (["data=aime24", "model=qwen3_4b"], 3000),
    (["data=jsonl", "model=qwen3_4b"], 1024),  # verl's GSM8K/MATH examples
    (["data=parquet", "model=qwen3_4b"], 1024),
    (["data=code_r1", "model=qwen3_4b"], 4096),
    (["data=livecodebench", "model=qwen3_4b"], 4096),
])
def test_real_data_presets_compose_a_budget_that_fits(overrides, minimum):
    _fits(_compose(*overrides), minimum)


def test_every_data_config_but_the_built_in_tasks_sets_a_real_budget():
    """No data config falls back to the tiny task's 8 tokens (`algorithm.max_new_tokens` reads the data's
    `task_max_new_tokens`)."""
    for path in sorted((REPO / "conf" / "data").glob("*.yaml")):
        cfg = _compose(f"data={path.stem}")
        if path.stem.startswith("arithmetic"):
            continue
        assert cfg.algorithm.max_new_tokens >= 1024, path.stem
        assert cfg.task_max_new_tokens == cfg.algorithm.max_new_tokens, path.stem


def test_readme_eight_gpu_command_composes_dapo_maths_budget():
    command = _readme_block("One node, 8 GPUs")
    assert command[:4] == ["torchrun", "--nproc_per_node", "8", "train.py"]
    overrides = [a for a in command[4:] if not a.startswith(("trainer=", "hydra."))]
    cfg = _compose(*overrides)
    assert cfg.data.fields == "dapo_math"
    _fits(cfg, 8192)


def test_readme_bring_your_own_command_fits_its_model(tmp_path):
    """The README's own-model command on a model folder of 256 positions (the tests' tiny folder): its budget fits,
    and the config check passes before any work."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    command = _readme_block("### Bring your own")
    assert command[:2] == ["python", "train.py"]
    cfg = _compose(*[a.replace("$MODEL_DIR", str(tmp_path)) for a in command[2:]])
    assert 8 <= cfg.algorithm.max_new_tokens < 256
    check_config(cfg)


def test_a_budget_below_the_datas_answers_is_refused_before_any_work():
    with pytest.raises(ConfigError) as err:
        check_config(_compose("data=dapo_math", "model=qwen3_4b", "data.path=x.parquet", "algorithm.max_new_tokens=8"))
    assert err.value.problems == [
        "algorithm.max_new_tokens=8 is not valid: expected an integer >= 1024 (data.answer_tokens: this data's "
        "completions need about that many tokens, and shorter ones are cut before their answer)"]
    # with an environment the budget is env.max_tokens: named instead
    with pytest.raises(ConfigError, match=r"^env.max_tokens=64 is not valid: expected an integer >= 512"):
        check_config(_compose("data=math500", "model=qwen3_4b", "data.path=x.jsonl", "env=retry",
                              "env.max_tokens=64"))
    check_config(_compose("data=dapo_math", "model=qwen3_4b", "data.path=x.parquet", "algorithm.max_new_tokens=4096"))


def test_the_datamodule_refuses_the_same_budget_on_every_entry_point(tmp_path):
    """The Lightning CLI and Python reach the datamodule's setup with the module's response budget."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    datamodule = RLVRDataModule(task=None, path=str(rows), answer_tokens=512)
    module = SimpleNamespace(response_budget=(64, "algorithm.max_new_tokens"))
    datamodule.trainer = SimpleNamespace(lightning_module=module, global_rank=0)
    with pytest.raises(ConfigError, match=r"^algorithm.max_new_tokens=64 is not valid: expected an integer >= 512"):
        datamodule.setup("fit")
    module.response_budget = (512, "algorithm.max_new_tokens")
    datamodule.setup("fit")
    assert len(datamodule.train_set) == 1
