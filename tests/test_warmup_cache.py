"""The warm-up cache (issue 34, class 6): an entry is complete or absent. A truncated, altered or missing file is
found before anything loads it, named, and the entry rebuilt; where the cache cannot be written, refused with
the command that clears it. `LIT_RLVR_CACHE` empty, a file, under a file, or read-only is one line naming the
variable and the directory, from train.py, the Lightning CLI and Python. With FAULT_REPORT=PATH each test
appends a JSON line (scripts/fault_report.py)."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_rlvr.models import load_policy
from lit_rlvr.rollout import warmup
from lit_rlvr.rollout.warmup import resolve_model_path
from lit_rlvr.run import cache_entry
from tests import full_disk
from tests.test_faults import report

REPO = Path(__file__).resolve().parents[1]
FAST = dict(max_steps=2, batch_size=4, eval_every=1, eval_problems=4, target=1.0)  # seconds, not minutes
needs_namespaces = pytest.mark.skipif(not full_disk.namespaces_work(), reason="no user namespaces (unshare -Urm)")


def _truncate(entry: Path) -> None:
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _flip_a_byte(entry: Path) -> None:
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # a weight's bits: same size, still parses
    weights.write_bytes(bytes(data))


def _legacy_truncated(entry: Path) -> None:  # written before manifests, and cut short
    (entry / cache_entry.MANIFEST).unlink()
    _truncate(entry)


CORRUPTIONS = {
    "truncated weights": _truncate,
    "a flipped byte in the weights": _flip_a_byte,
    "tokenizer.json deleted": lambda e: (e / "tokenizer.json").unlink(),
    "config.json empty": lambda e: (e / "config.json").write_text(""),
    "garbage manifest": lambda e: (e / cache_entry.MANIFEST).write_bytes(os.urandom(64)),
    "no manifest, truncated weights": _legacy_truncated,
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return warmup.warm_start_tiny(tmp_path_factory.mktemp("cache"), **FAST)


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupt_entry_is_named_and_rebuilt(built, tmp_path, kind, caplog):
    cache = tmp_path / "cache"
    shutil.copytree(built.parent, cache)
    entry = cache / built.name
    CORRUPTIONS[kind](entry)
    with caplog.at_level(logging.WARNING):
        path = warmup.warm_start_tiny(cache, **FAST)
    assert path == entry and cache_entry.verify(entry) is None
    warned = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(warned) == 1 and str(entry) in warned[0] and "rebuilding" in warned[0], warned
    model, _ = load_policy(str(path))  # what today's code fails on: a safetensors error naming no file
    assert sum(p.numel() for p in model.parameters()) > 0
    assert sorted(p.name for p in cache.iterdir()) == [entry.name, f"{entry.name}.lock"]  # nothing aside left
    report(fault=f"warm-up cache: {kind}", bad_inputs=1, survived=True, data_lost=0)


def test_an_entry_from_before_manifests_is_used_and_gets_one(built, tmp_path, caplog):
    cache = tmp_path / "cache"
    shutil.copytree(built.parent, cache)
    (cache / built.name / cache_entry.MANIFEST).unlink()
    with caplog.at_level(logging.INFO):
        path = warmup.warm_start_tiny(cache, **FAST)
    assert not any("warm-starting" in r.getMessage() for r in caplog.records)  # not trained again
    assert (path / cache_entry.MANIFEST).is_file() and cache_entry.verify(path) is None


@needs_namespaces
def test_read_only_cache_uses_a_complete_entry_and_refuses_a_corrupt_one_with_the_command(built, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(built.parent, cache)
    script = f"""
import json
from lit_rlvr.rollout import warmup
print(json.dumps({{"path": str(warmup.warm_start_tiny({str(cache)!r}, **{FAST!r}))}}))
"""
    done = full_disk.run([sys.executable, "-c", script], read_only=[cache], cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["path"] == str(cache / built.name)  # a shared read-only cache
    _truncate(cache / built.name)
    done = full_disk.run([sys.executable, "-c", script], read_only=[cache], cwd=REPO)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "StorageError" in last and f"rm -rf '{cache / built.name}'" in last, last
    assert "model.safetensors has" in last


def _cache_case(name: str, tmp_path: Path) -> tuple[str, str]:
    """(LIT_RLVR_CACHE, text the line must hold) for each kind of bad setting."""
    afile = tmp_path / "a_file"
    afile.write_text("not a directory")
    return {"empty": ("", "LIT_RLVR_CACHE='' is set but empty"),
            "a file": (str(afile), f"LIT_RLVR_CACHE='{afile}': {afile} is a file"),
            "under a file": (str(afile / "cache"), f"LIT_RLVR_CACHE='{afile / 'cache'}': {afile} is a file"),
            "read-only": (str(tmp_path / "ro"), f"cannot write the warm-up cache directory {tmp_path / 'ro'}: "
                                               "Read-only file system")}[name]


CASES = ["empty", "a file", "under a file", "read-only"]


def _one_line(done: subprocess.CompletedProcess) -> str:
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out, out[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == "(set LIT_RLVR_DEBUG=1 for the traceback)", lines[-5:]
    return lines[-2]


def _entry(kind: str, command: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    value, _ = _cache_case(kind, tmp_path)
    env = {**os.environ, "LIT_RLVR_CACHE": value}
    if kind != "read-only":
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    (tmp_path / "ro").mkdir()
    return full_disk.run(command, read_only=[tmp_path / "ro"], cwd=REPO, env=env)


@pytest.mark.parametrize("kind", CASES)
def test_bad_lit_rlvr_cache_is_one_line_from_train_py(kind, tmp_path):
    if kind == "read-only" and not full_disk.namespaces_work():
        pytest.skip("no user namespaces (unshare -Urm)")
    done = _entry(kind, [sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=1",
                         "eval_before=false", "callbacks.progress=null"], tmp_path)
    line = _one_line(done)
    assert "LIT_RLVR_CACHE" in line and _cache_case(kind, tmp_path)[1] in line, line
    assert not any(p.name.startswith("tiny-") for p in REPO.iterdir())  # nothing written into the current dir
    report(fault=f"LIT_RLVR_CACHE {kind}", bad_inputs=1, survived=False, stopped_cleanly=True, data_lost=0)


def test_empty_lit_rlvr_cache_is_the_same_line_from_the_cli_and_python(tmp_path, monkeypatch):
    cli = [sys.executable, "-m", "lit_rlvr.app.cli", "fit", "--config", str(REPO / "conf/cli/tiny_grpo.yaml"),
           "--trainer.max_steps", "1", "--trainer.logger.init_args.save_dir", str(tmp_path / "cli")]
    line = _one_line(_entry("empty", cli, tmp_path))
    assert _cache_case("empty", tmp_path)[1] in line, line
    monkeypatch.setenv("LIT_RLVR_CACHE", "")
    with pytest.raises(ValueError) as err:
        resolve_model_path("tiny", {})
    assert line == f"config error: {err.value}"
