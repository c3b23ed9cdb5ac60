"""Prompt datasets from files: JSONL, Parquet (incl. verl's schema), HF `datasets`; prompt rendering.

A record is `{"prompt": str | list of chat messages, "answer": Any, **extra}`; `extra` holds the row's other
top-level columns. Field mapping: `fields` maps a record key to a source path in the row; dots walk into
nested objects (`"reward_model.ground_truth"`), and a `|name` suffix post-processes the value:
`|boxed` keeps the last `\\boxed{}` of a worked solution (MATH), `|after_hashes` the text after `####`
(GSM8K). `fields` may also name a preset (`PRESETS`). A bad row raises `DataError` naming the file, the
1-based row and the field, or is skipped and counted with `on_bad_row="skip"`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Mapping
from typing import Any, Iterator, Optional

from lit_rlvr.config.errors import DataError
from lit_rlvr.config.extras import require
from lit_rlvr.config.settings import DATA_FORMATS
from lit_rlvr.rewards.math import last_boxed

log = logging.getLogger(__name__)

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

PRESETS: dict[str, dict[str, str]] = {
    "default": {"prompt": "prompt", "answer": "answer"},
    "verl": {"prompt": "prompt", "answer": "reward_model.ground_truth"},  # prompt = chat messages
    "dapo_math": {"prompt": "prompt", "answer": "reward_model.ground_truth"},  # DAPO-Math-17k is verl schema
    "math": {"prompt": "problem", "answer": "solution|boxed"},  # hendrycks MATH
    "gsm8k": {"prompt": "question", "answer": "answer|after_hashes"},
}
FORMATS = DATA_FORMATS
_SUFFIX_FORMAT = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_HF_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


class _BadRow(Exception):
    def __init__(self, reason: str, field: str, problem: str):
        super().__init__(f"field '{field}': {problem}")
        self.reason = reason  # key of stats["skipped_by_reason"]


def load_records(
    path_or_name: str,
    *,
    format: str = "auto",
    split: str = "train",
    fields: Mapping[str, str] | str | None = None,
    on_bad_row: str = "error",
    max_prompt_chars: Optional[int] = None,
    row_numbers: Optional[list[int]] = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Read prompt records from a file or an HF dataset.

    Args:
        path_or_name: a .jsonl / .parquet file, an HF-loadable local file (.json, .csv, .arrow) or folder
            (incl. one written by `save_to_disk`), or an HF hub name (needs network).
        format: "auto" (by suffix; folders, other files and names go to HF), "jsonl", "parquet" or "hf".
        split: HF split to read; a single jsonl/parquet file is one split and ignores it.
        fields: record key -> source path (merged over the default `prompt`/`answer`), or a preset name.
        on_bad_row: "error" raises `DataError` at the first bad row; "skip" drops bad rows and counts them.
        max_prompt_chars: prompts longer than this (characters of text, summed over messages) are bad rows.
        row_numbers: if a list, the 1-based file row of each kept record is appended to it.

    Returns:
        records, stats `{"rows": read, "kept": n, "skipped": m, "skipped_by_reason": {reason: count}}`.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row={on_bad_row!r} is not valid; valid: error, skip")
    mapping = resolve_fields(fields)
    kind = _detect_format(str(path_or_name), format)
    rows = {"jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf}[kind](str(path_or_name), split)
    records, skipped, total = [], Counter(), 0
    for row_no, row in rows:
        total += 1
        try:
            if isinstance(row, _BadRow):
                raise row
            records.append(_to_record(row, mapping, max_prompt_chars))
            if row_numbers is not None:
                row_numbers.append(row_no)
        except _BadRow as bad:
            if on_bad_row == "error":
                raise DataError(f"{path_or_name}: row {row_no}: {bad}. Fix the row, map the field with "
                                f"fields={{...}} (presets: {', '.join(PRESETS)}), or pass on_bad_row='skip'") from None
            skipped[bad.reason] += 1
    stats = {"rows": total, "kept": len(records), "skipped": sum(skipped.values()), "skipped_by_reason": dict(skipped)}
    if skipped:
        log.warning("%s: skipped %d of %d rows %s", path_or_name, stats["skipped"], total, dict(skipped))
    return records, stats


def resolve_fields(fields: Mapping[str, str] | str | None) -> dict[str, str]:
    """A preset name or a partial mapping -> the full mapping record key -> source path."""
    if fields is None:
        return dict(PRESETS["default"])
    if isinstance(fields, str):
        if fields not in PRESETS:
            raise ValueError(f"fields={fields!r} is not a preset; valid: {', '.join(PRESETS)} (or a mapping)")
        return dict(PRESETS[fields])
    mapping = {**PRESETS["default"], **{str(k): str(v) for k, v in fields.items()}}
    for key, source in mapping.items():
        transform = source.partition("|")[2]
        if transform and transform not in _TRANSFORMS:
            raise ValueError(f"fields.{key}={source!r}: unknown '|{transform}'; valid: {', '.join(_TRANSFORMS)}")
    return mapping


# ------------------------------------------------------------------------------------------------------
# Readers: each yields (1-based row number, row dict or _BadRow).


def _detect_format(path: str, format: str) -> str:
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not valid; valid: {', '.join(FORMATS)}")
    if format != "auto":
        if format in ("jsonl", "parquet") and not os.path.isfile(path):
            raise DataError(f"{path}: no such file (format={format!r})")
        return format
    return _SUFFIX_FORMAT.get(os.path.splitext(path)[1].lower(), "hf") if os.path.isfile(path) else "hf"


def _read_jsonl(path: str, split: str) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:  # bytes: a bad UTF-8 line must name its row, not abort the whole read
        for row_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield row_no, _BadRow("invalid_utf8", "<row>", f"invalid UTF-8 at byte {err.start}")
                continue
            line = line.lstrip("\ufeff") if row_no == 1 else line
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not rows
            try:
                yield row_no, json.loads(line)
            except json.JSONDecodeError as err:
                yield row_no, _BadRow("invalid_json", "<row>", f"invalid JSON ({err.msg} at column {err.colno})")
            except RecursionError:  # the decoder recurses per nesting level: a row nested ~1000 deep exhausts it
                yield row_no, _BadRow("invalid_json", "<row>", "JSON nested deeper than Python's decoder can read")


def _read_parquet(path: str, split: str) -> Iterator[tuple[int, Any]]:
    pq = require("pyarrow.parquet")

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise DataError(f"{path}: cannot read as Parquet ({err})") from err
    yield from enumerate(table.to_pylist(), 1)


def _read_hf(path_or_name: str, split: str) -> Iterator[tuple[int, Any]]:
    yield from enumerate(_load_hf(path_or_name, split), 1)


def _load_hf(path_or_name: str, split: str) -> Any:
    datasets = require("datasets")

    try:
        if os.path.isdir(path_or_name) and _is_saved_to_disk(path_or_name):
            data = datasets.load_from_disk(path_or_name)
            return data[split] if isinstance(data, datasets.DatasetDict) else data
        if os.path.isfile(path_or_name):
            builder = _HF_BUILDERS.get(os.path.splitext(path_or_name)[1].lower())
            if builder is None:
                raise DataError(f"{path_or_name}: unknown file type; use .jsonl, .json, .csv, .parquet or .arrow")
            return datasets.load_dataset(builder, data_files={split: path_or_name}, split=split)  # one file = one split
        if os.path.isdir(path_or_name):
            return datasets.load_dataset(path_or_name, split=split)
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"{path_or_name}: cannot load split '{split}' with HF datasets ({err})") from err
    try:
        return datasets.load_dataset(path_or_name, split=split)
    except Exception as err:  # offline, unknown name, gated, …: all end here
        raise DataError(f"'{path_or_name}' is not a local file or folder, and loading it from the HF hub failed "
                        f"({type(err).__name__}: {err}). The hub needs network access; otherwise pass a local "
                        "path (.jsonl, .parquet, or a folder written by datasets' save_to_disk)") from err


def _is_saved_to_disk(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, f)) for f in ("dataset_dict.json", "state.json"))


# ------------------------------------------------------------------------------------------------------
# Rows -> records.


def _to_record(row: Any, mapping: dict[str, str], max_prompt_chars: Optional[int]) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise _BadRow("wrong_type", "<row>", f"expected an object, got {type(row).__name__}")
    mapped = {key: _field(row, source) for key, source in mapping.items()}
    _check_prompt(mapped["prompt"], mapping["prompt"], max_prompt_chars)
    _check_answer(mapped["answer"], mapping["answer"])
    used = {source.partition("|")[0].split(".")[0] for source in mapping.values()}
    return {**{k: v for k, v in row.items() if k not in used}, **mapped}


def _field(row: Mapping, source: str) -> Any:
    path, _, transform = source.partition("|")
    value = _lookup(row, path)
    if value is None:
        raise _BadRow("missing_field", path, "missing")
    return _TRANSFORMS[transform](value, path) if transform else value


def _lookup(row: Mapping, path: str) -> Any:
    if path in row:  # a flat column may itself contain dots
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _last_boxed_answer(value: Any, path: str) -> str:
    boxed = last_boxed(value) if isinstance(value, str) else None
    if not boxed:
        raise _BadRow("no_answer", path, "no complete \\boxed{...} answer in the solution")
    return boxed.strip()


def _after_hashes(value: Any, path: str) -> str:
    if not isinstance(value, str) or "####" not in value:
        raise _BadRow("no_answer", path, "no '#### answer' line")
    return value.rsplit("####", 1)[1].strip()


_TRANSFORMS = {"boxed": _last_boxed_answer, "after_hashes": _after_hashes}


def _check_prompt(prompt: Any, field: str, max_chars: Optional[int]) -> None:
    if isinstance(prompt, str):
        length = len(prompt.strip())
    elif isinstance(prompt, list) and all(_is_message(m) for m in prompt):
        length = sum(len(m["content"].strip()) for m in prompt)
    else:
        raise _BadRow("wrong_type", field, f"expected a string or a list of {{role, content}} messages, "
                                           f"got {type(prompt).__name__}")
    if length == 0:
        raise _BadRow("empty_field", field, "empty prompt")
    if max_chars is not None and length > max_chars:
        raise _BadRow("prompt_too_long", field, f"prompt has {length} characters, over max_prompt_chars={max_chars}")


def _is_message(message: Any) -> bool:
    return isinstance(message, Mapping) and isinstance(message.get("role"), str) and isinstance(
        message.get("content"), str)


def _check_answer(answer: Any, field: str) -> None:
    items = answer if isinstance(answer, (list, tuple)) else [answer]
    if not items or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in items):
        raise _BadRow("wrong_type", field, f"expected a string or number (or a list of them), got {answer!r:.60}")
    if any(isinstance(a, float) and not math.isfinite(a) for a in items):  # JSON's NaN/Infinity: no answer
        raise _BadRow("wrong_type", field, f"expected a finite number, got {answer!r:.60}")
    if any(isinstance(a, str) and not a.strip() for a in items):
        raise _BadRow("empty_field", field, "empty answer")


# ------------------------------------------------------------------------------------------------------
# Order, sharding, rendering.


def as_messages(prompt: Any, instruction: Optional[str] = None, system_prompt: Optional[str] = None) -> list[dict]:
    """Chat messages of a prompt: `instruction` appended to the last user turn; `system_prompt` added as the
    first message unless there is a system message already."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if instruction:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
        messages[last_user]["content"] = f"{messages[last_user]['content'].rstrip()}\n{instruction}"
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages

def render_prompt(
    prompt: str | list[dict[str, str]],
    tokenizer: Any,
    *,
    chat_template: bool,
    system_prompt: Optional[str] = None,
    instruction: Optional[str] = None,
) -> str:
    """Prompt text for the engine.

    With `chat_template=True` and a tokenizer that has one: `apply_chat_template(messages,
    add_generation_prompt=True, tokenize=False)`. Otherwise plain text: the string itself, or messages as
    "role: content" lines. `system_prompt` adds a system message (unless one is there); `instruction` is
    appended to the last user turn, e.g. `MATH_INSTRUCTION`.
    """
    messages = as_messages(prompt, instruction, system_prompt)
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if isinstance(prompt, str) and len(messages) == 1:
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
