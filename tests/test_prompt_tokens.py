"""Prompt length in tokens (issue 19, point 10): rows longer than `data.max_prompt_tokens` (default: the model's
context minus max_new_tokens) fail when the data loads, naming file and row, or are skipped with
`on_bad_row=skip`; a 10 MB prompt is refused without tokenizing all of it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_rlvr.config.errors import DataError
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.data.lengths import over_limit, token_limit

REPO = Path(__file__).resolve().parents[1]


def chars(text: str) -> list[str]:  # a character tokenizer, like the tiny model's
    return list(text)


def _jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def test_token_limit_defaults_to_context_minus_new_tokens():
    assert token_limit(None, 256, 8)[0] == 248
    assert token_limit(100, 256, 8) == (100, "data.max_prompt_tokens=100")
    with pytest.raises(ValueError, match="algorithm.max_new_tokens=300"):
        token_limit(None, 256, 300)


def test_a_huge_prompt_is_refused_after_tokenizing_a_prefix():
    seen = []

    def tokenize(text):
        seen.append(len(text))
        return chars(text)

    huge = "7 + " * 2_500_000  # 10 MB
    assert over_limit(huge, tokenize, 248).startswith("more than 248 tokens")
    assert max(seen) <= 8 * 250
    assert over_limit("x" * 248, tokenize, 248) is None and over_limit("x" * 249, tokenize, 248) == "249 tokens"


def _module(path: Path, **kwargs) -> RLVRDataModule:
    dm = RLVRDataModule(task=None, path=str(path), batch_size=1, **kwargs)
    dm.setup("fit")
    return dm


def test_long_rows_fail_naming_file_and_row(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", ["1 + 1 =", "2 + 2 =", "x" * 300, "3 + 3 =", "y" * 500])
    dm = _module(path)
    with pytest.raises(DataError, match=rf"{path}: row 3: the prompt has 300 tokens, more than 248 .*context 256.*"
                                        r"on_bad_row=skip \(2 rows"):
        dm.check_prompt_tokens(lambda p: p, chars, context=256, max_new_tokens=8)
    with pytest.raises(DataError, match=r"row 1: the prompt has 7 tokens, more than 5 \(data.max_prompt_tokens=5\)"):
        _module(path, max_prompt_tokens=5).check_prompt_tokens(lambda p: p, chars, context=256, max_new_tokens=8)


def test_long_rows_are_skipped_and_counted_with_on_bad_row_skip(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", ["1 + 1 =", "x" * 300, "3 + 3 =", "y" * 500, "4 + 4 ="])
    dm = _module(path, on_bad_row="skip", eval_limit=3, instruction="Answer.")
    dm.check_prompt_tokens(lambda p: p, chars, context=256, max_new_tokens=8)
    assert [dm.train_set[i]["prompt"] for i in range(len(dm.train_set))] == [
        "1 + 1 =\nAnswer.", "3 + 3 =\nAnswer.", "4 + 4 =\nAnswer."]
    assert len(dm.eval_set) == 3 and dm.load_stats[str(path)]["skipped_by_reason"] == {"prompt_tokens": 2}
    assert dm.load_stats[str(path)]["kept"] == 3


def test_train_py_refuses_a_10mb_prompt_naming_the_row(tmp_path):
    path = _jsonl(tmp_path / "big.jsonl", ["1 + 1 ="] * 4 + ["9 + " * 2_500_000] + ["2 + 2 ="] * 3)
    proc = subprocess.run([sys.executable, "train.py", "data=jsonl", f"data.path={path}", "reward=arithmetic",
                           "algorithm.max_new_tokens=8",
                           "data.batch_size=4", "algorithm.group_size=2", "callbacks.progress=null",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"{path}: row 5: the prompt has more than 248 tokens" in out, out[-3000:]
    assert "MemoryError" not in out and not (tmp_path / "run" / "checkpoints").exists()
    if os.environ.get("FAULT_REPORT"):
        with open(os.environ["FAULT_REPORT"], "a") as handle:
            handle.write(json.dumps({"fault": "10 MB prompt", "bad_inputs": 1, "survived": False,
                                     "stopped_cleanly": True, "data_lost": 0}) + "\n")
