"""Prompt files: JSONL, Parquet, verl Parquet, HF datasets from local files; bad rows; rendering."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lit_rlvr.config.errors import DataError
from lit_rlvr.data.formats import MATH_INSTRUCTION, load_records, render_prompt

GOOD = {"prompt": "What is 2 + 2?", "answer": "4"}


def write_jsonl(path, rows):
    """rows: dicts (dumped as JSON) or raw bytes (written as one line)."""
    with open(path, "wb") as f:
        for row in rows:
            f.write((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n")
    return str(path)


@pytest.fixture(autouse=True)
def hf_offline_tmp_cache(tmp_path, monkeypatch):
    # Keep HF's cache out of $HOME and make hub look-ups fail at once instead of retrying for ~25 s.
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# ------------------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_records_keep_extra_fields_and_chat_prompts(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{**GOOD, "id": 7}, {"prompt": chat, "answer": 2}, b""])
    records, stats = load_records(path)
    assert records == [{"prompt": GOOD["prompt"], "answer": "4", "id": 7}, {"prompt": chat, "answer": 2}]
    assert stats == {"rows": 2, "kept": 2, "skipped": 0, "skipped_by_reason": {}}


BAD_ROWS = [  # (row, field named in the message, reason counted when skipped, words in the message)
    ({"prompt": "q"}, "answer", "missing_field", "missing"),
    ({"prompt": "q", "answer": None}, "answer", "missing_field", "missing"),
    ({"answer": "1"}, "prompt", "missing_field", "missing"),
    ({"prompt": "   ", "answer": "1"}, "prompt", "empty_field", "empty prompt"),
    ({"prompt": [], "answer": "1"}, "prompt", "empty_field", "empty prompt"),
    ({"prompt": "q", "answer": ""}, "answer", "empty_field", "empty answer"),
    ({"prompt": 12, "answer": "1"}, "prompt", "wrong_type", "expected a string or a list"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "prompt", "wrong_type", "messages"),
    ({"prompt": "q", "answer": {"x": 1}}, "answer", "wrong_type", "expected a string or number"),
    ({"prompt": "q" * 50, "answer": "1"}, "prompt", "prompt_too_long", "50 characters"),
    (b'{"prompt": "caf\xe9", "answer": "1"}', "<row>", "invalid_utf8", "invalid UTF-8"),
    (b'{"prompt": "q", "answer": ', "<row>", "invalid_json", "invalid JSON"),
    (b"[1, 2]", "<row>", "wrong_type", "expected an object"),
    (b'{"prompt": "q", "answer": NaN}', "answer", "wrong_type", "expected a finite number"),
    (b'{"prompt": "q", "answer": [1, -Infinity]}', "answer", "wrong_type", "expected a finite number"),
    (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b', "answer": "1"}', "<row>", "invalid_json", "nested deeper"),
]


@pytest.mark.parametrize("bad,field,reason,words", BAD_ROWS,
                         ids=lambda v: repr(v)[:40] if isinstance(v, bytes) else None)
def test_jsonl_bad_row_error_names_file_row_field(tmp_path, bad, field, reason, words):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as err:
        load_records(path, max_prompt_chars=40)
    message = str(err.value)
    assert "bad.jsonl" in message and "row 3" in message and f"field '{field}'" in message
    assert words in message and "on_bad_row='skip'" in message


def test_jsonl_skip_counts_each_reason(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD] + [bad for bad, *_ in BAD_ROWS] + [GOOD])
    records, stats = load_records(path, on_bad_row="skip", max_prompt_chars=40)
    assert len(records) == 2
    expected = {}
    for _, _, reason, _ in BAD_ROWS:
        expected[reason] = expected.get(reason, 0) + 1
    assert stats == {"rows": len(BAD_ROWS) + 2, "kept": 2, "skipped": len(BAD_ROWS), "skipped_by_reason": expected}


def test_row_numbers_count_blank_lines_as_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, b"", {"prompt": "q"}])
    with pytest.raises(DataError, match="row 3: field 'answer'"):
        load_records(path)


def test_gsm8k_preset(tmp_path):
    rows = [{"question": "Tom has 3 apples...", "answer": "3 + 4 = 7\n#### 7"}, {"question": "q",
                                                                                 "answer": "no hashes"}]
    records, stats = load_records(write_jsonl(tmp_path / "gsm8k.jsonl", rows), fields="gsm8k", on_bad_row="skip")
    assert records == [{"prompt": "Tom has 3 apples...", "answer": "7"}]
    assert stats["skipped_by_reason"] == {"no_answer": 1}


# ------------------------------------------------------------------------------------------------------
# Parquet, verl schema


def test_parquet_and_bad_row(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([GOOD, {"prompt": "q", "answer": None}, GOOD]), path)
    with pytest.raises(DataError, match=r"d\.parquet: row 2: field 'answer': missing"):
        load_records(path)
    records, stats = load_records(path, on_bad_row="skip")
    assert records == [GOOD, GOOD] and stats["skipped_by_reason"] == {"missing_field": 1}


def verl_row(index, truth):
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"Problem {index}"}],
            "ability": "MATH", "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(index)}}


@pytest.mark.parametrize("fields", ["verl", "dapo_math", {"answer": "reward_model.ground_truth"}])
def test_verl_parquet(tmp_path, fields):
    path = str(tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist([verl_row(0, "34"), verl_row(1, None), verl_row(2, "1/2")]), path)
    with pytest.raises(DataError, match=r"dapo\.parquet: row 2: field 'reward_model\.ground_truth': missing"):
        load_records(path, fields=fields)
    records, stats = load_records(path, fields=fields, on_bad_row="skip")
    assert [r["answer"] for r in records] == ["34", "1/2"]
    assert records[0]["prompt"] == [{"role": "user", "content": "Problem 0"}]
    assert records[0]["data_source"] == "math_dapo" and records[0]["extra_info"] == {"index": "0"}
    assert "reward_model" not in records[0]  # consumed by the mapping
    assert stats == {"rows": 3, "kept": 2, "skipped": 1, "skipped_by_reason": {"missing_field": 1}}


def test_verl_parquet_without_mapping_says_how_to_map(tmp_path):
    path = str(tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist([verl_row(0, "34")]), path)
    with pytest.raises(DataError, match="row 1: field 'answer': missing.*verl"):
        load_records(path)


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_text("not parquet")
    with pytest.raises(DataError, match="x.parquet: cannot read as Parquet"):
        load_records(str(path))


# ------------------------------------------------------------------------------------------------------
# HF datasets (local)


def test_hf_local_json_with_math_preset(tmp_path):
    rows = [{"problem": "Compute 1/2 + 1/4.", "solution": "Sum is $\\boxed{\\frac{3}{4}}$.", "level": "Level 1"},
            {"problem": "p2", "solution": "no boxed answer here", "level": "Level 2"},
            {"problem": "", "solution": "\\boxed{1}", "level": "Level 3"}]
    path = tmp_path / "math.json"
    path.write_text(json.dumps(rows))
    records, stats = load_records(str(path), fields="math", on_bad_row="skip")  # .json goes to HF datasets
    assert records == [{"prompt": "Compute 1/2 + 1/4.", "answer": "\\frac{3}{4}", "level": "Level 1"}]
    assert stats == {"rows": 3, "kept": 1, "skipped": 2, "skipped_by_reason": {"no_answer": 1, "empty_field": 1}}
    with pytest.raises(DataError, match=r"math\.json: row 2: field 'solution': no complete \\boxed"):
        load_records(str(path), format="hf", fields="math")


def test_hf_save_to_disk_folder_picks_split(tmp_path):
    import datasets

    folder = str(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([GOOD]),
                          "test": datasets.Dataset.from_list([{"prompt": "t", "answer": "1"}])}).save_to_disk(folder)
    assert load_records(folder, split="test")[0] == [{"prompt": "t", "answer": "1"}]
    assert load_records(folder, format="hf")[0] == [GOOD]
    with pytest.raises(DataError, match="cannot load split 'validation'"):
        load_records(folder, split="validation")


def test_hub_name_without_network_says_so():
    with pytest.raises(DataError, match="needs network access.*local path"):
        load_records("some-org/some-dataset-that-is-not-here")


def test_invalid_options(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(ValueError, match="valid: auto, jsonl, parquet, hf"):
        load_records(path, format="csv")
    with pytest.raises(ValueError, match="valid: default, verl"):
        load_records(path, fields="nope")
    with pytest.raises(ValueError, match="valid: error, skip"):
        load_records(path, on_bad_row="ignore")
    with pytest.raises(ValueError, match="unknown '|upper'"):
        load_records(path, fields={"answer": "answer|upper"})
    with pytest.raises(DataError, match="no such file"):
        load_records(str(tmp_path / "missing.jsonl"), format="jsonl")


# ------------------------------------------------------------------------------------------------------
# Rendering


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt is True and tokenize is False
        return "<chat>" + "|".join(f"{m['role']}={m['content']}" for m in messages) + "<assistant>"


def test_render_prompt():
    chat = [{"role": "user", "content": "2+2?"}]
    assert render_prompt("2+2?", FakeTokenizer(), chat_template=True) == "<chat>user=2+2?<assistant>"
    assert render_prompt(chat, FakeTokenizer(), chat_template=False) == "user: 2+2?"
    assert render_prompt("2+2?", None, chat_template=False) == "2+2?"
    no_template = FakeTokenizer()
    no_template.chat_template = None
    assert render_prompt(chat, no_template, chat_template=True) == "user: 2+2?"  # falls back to plain text
    text = render_prompt("2+2?", FakeTokenizer(), chat_template=True, system_prompt="S", instruction=MATH_INSTRUCTION)
    assert text == f"<chat>system=S|user=2+2?\n{MATH_INSTRUCTION}<assistant>"
    assert render_prompt("2+2?", None, chat_template=False, instruction="Think.") == "2+2?\nThink."
    assert chat == [{"role": "user", "content": "2+2?"}]  # the record is not modified


def test_too_few_usable_training_rows_fail_naming_the_file_and_keys(tmp_path):
    """on_bad_row=skip with the wrong columns drops every row: the run must not start with no batches."""
    from lit_rlvr.data.datamodule import RLVRDataModule

    path = tmp_path / "data.jsonl"
    write_jsonl(path, [{"question": f"{i}+1", "solution": str(i + 1)} for i in range(5)])
    data = RLVRDataModule(path=str(path), batch_size=8, on_bad_row="skip")
    with pytest.raises(DataError,
                       match=r"data\.jsonl: 0 usable training rows \(5 skipped\).*data\.batch_size=8.*data\.fields"):
        data.setup("fit")
        data.train_dataloader()


def test_held_out_shards_are_equal_on_every_rank(caplog):
    """Each validation step pushes weights (a collective): ranks with unequal shares would hang."""
    import types

    from lit_rlvr.data.datamodule import RLVRDataModule

    data = RLVRDataModule(num_test=5, eval_batch_size=2)
    data.setup("validate")
    shards = []
    for rank in range(2):
        data.trainer = types.SimpleNamespace(world_size=2, global_rank=rank, _accelerator_connector=None)
        with caplog.at_level(logging.WARNING, logger="lit_rlvr.data.datamodule"):
            shards.append([p for batch in data.val_dataloader() for p in batch["prompt"]])
    assert len(shards[0]) == len(shards[1]) == 2 and not set(shards[0]) & set(shards[1])
    assert "the last 1 of 5 prompts are not scored" in caplog.text
    data.eval_set = data.eval_set[:1] if isinstance(data.eval_set, list) else torch.utils.data.Subset(data.eval_set,
                                                                                                      [0])
    with pytest.raises(ValueError, match=r"held-out set has 1 prompts, fewer than the 2 ranks.*data\.num_test"):
        data.val_dataloader()
