"""Hostile inputs, third round (issue 42), the "machine" classes: a script run without `--doc` must not overwrite
a committed results page (a smoke run would replace the published tables)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import reproduce  # noqa: E402

COMMITTED = (ROOT / "docs" / "results").resolve()


def _committed(doc: str) -> bool:
    return COMMITTED in (ROOT / doc).resolve().parents


@pytest.mark.parametrize("script, argv", [
    (reproduce, []), (reproduce, ["--task", "arithmetic_cot"]),
    (reproduce, ["--steps", "2", "--seeds", "1", "--methods", "grpo_g4"])])  # the last: a smoke run
def test_a_run_without_doc_writes_its_report_beside_its_runs(script, argv, tmp_path):
    args = script.parse_args(argv)
    assert not _committed(args.doc), args.doc
    assert Path(args.doc).parent.is_relative_to(Path(args.out_dir))
    moved = script.parse_args([*argv, "--out-dir", str(tmp_path)])
    assert Path(moved.doc).parent.is_relative_to(tmp_path) and Path(moved.doc).suffix == ".md"


@pytest.mark.parametrize("script, argv, page", [
    (reproduce, [], "docs/results/reproduction.md"),
    (reproduce, ["--task", "arithmetic_cot"], "docs/results/reproduction_cot.md")])
def test_the_committed_page_is_written_when_named(script, argv, page):
    assert (ROOT / page).is_file()  # the page the flag names exists (the docstrings' commands stay true)
    assert script.parse_args([*argv, "--doc", page]).doc == page
