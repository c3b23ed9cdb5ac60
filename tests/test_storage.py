"""Full disks and unwritable run directories (issue 34, classes 4 and 8): every file a run writes (checkpoint,
metrics.csv, completions.jsonl, summary.json, the warm-up cache) ends, on a full disk, in one line naming the
cause, the path and the bytes needed, and loses nothing already saved; a run directory that cannot be written
is one line before Hydra opens its log file there. The disks are real: a small tmpfs or a read-only bind mount
in a user namespace (tests/full_disk.py), or a file size limit (RLIMIT_FSIZE), so the kernel answers ENOSPC,
EROFS or EFBIG itself. With FAULT_REPORT=PATH each test appends a JSON line (scripts/fault_report.py)."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import full_disk
from tests.test_faults import report

REPO = Path(__file__).resolve().parents[1]
SMALL = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
         "algorithm.group_size=4", "checkpoint_every=1"]
needs_namespaces = pytest.mark.skipif(not full_disk.namespaces_work(), reason="no user namespaces (unshare -Urm)")


def _child(script: str, disk: Path, kb: int, fill_kb: int = 0, **kwargs) -> dict:
    """Runs `script` (python, `DISK` is the disk's path) on a `kb` tmpfs; its last stdout line is JSON."""
    done = full_disk.run([sys.executable, "-c", f"from pathlib import Path\nDISK = Path({str(disk)!r})\n{script}"],
                         tmpfs=(disk, kb), cwd=REPO, **kwargs)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


FILL = '''
def fill():  # the disk's last free bytes taken by a filler file, as another program would
    import errno
    with open(DISK / "filler", "ab", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC


def free():
    (DISK / "filler").unlink()
'''


@needs_namespaces
@pytest.mark.parametrize("unnamed", [True, False])
def test_checkpoint_on_a_full_disk_is_one_line_and_the_old_one_stays(tmp_path, unnamed):
    """Both temp-file paths: the unnamed O_TMPFILE one and the named fallback of filesystems without it."""
    result = _child(f'''
import json, torch
from lit_rlvr.run import checkpoint_io
from lit_rlvr.config.errors import StorageError
if not {unnamed}:
    checkpoint_io._open_unnamed = lambda directory: None
path = DISK / "checkpoints" / "last.ckpt"
checkpoint_io.atomic_save({{"w": torch.ones(1000)}}, path)
try:
    checkpoint_io.atomic_save({{"w": torch.zeros(1_000_000)}}, path)  # 4 MB on a 1 MB disk
    message = None
except StorageError as err:
    message = str(err)
kept = torch.load(path)["w"]
files = sorted(p.name for p in path.parent.iterdir())
print(json.dumps({{"message": message, "kept": kept.sum().item(), "files": files}}))
''', tmp_path / "disk", 1024)
    message = result["message"]
    assert message and "\n" not in message and "No space left on device" in message, message
    assert str(tmp_path / "disk" / "checkpoints" / "last.ckpt") in message and "needs ~4.0 MB" in message
    assert "free there" in message and "resume=" in message
    assert result["kept"] == 1000.0 and result["files"] == ["last.ckpt"]  # the old one, no temp file


def test_checkpoint_over_the_file_size_limit_is_one_line(tmp_path):
    """EFBIG (ulimit -f): no namespace needed."""
    script = f'''
import json, resource, torch
from lit_rlvr.run.checkpoint_io import atomic_save
from lit_rlvr.config.errors import StorageError
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
path = __import__("pathlib").Path({str(tmp_path / "last.ckpt")!r})
atomic_save({{"w": torch.ones(1000)}}, path)
try:
    atomic_save({{"w": torch.zeros(1_000_000)}}, path)
    message = None
except StorageError as err:
    message = str(err)
print(json.dumps({{"message": message, "kept": torch.load(path)["w"].sum().item()}}))
'''
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "File too large" in result["message"] and "ulimit -f" in result["message"], result
    assert result["kept"] == 1000.0
    report(fault="checkpoint: disk full / file size limit", bad_inputs=3, survived=False, stopped_cleanly=True,
           data_lost=0)


@needs_namespaces
def test_metrics_csv_on_a_full_disk_keeps_its_rows(tmp_path):
    """A new column (the file rewritten) and a plain append, each on a full disk: one line, the file as it was;
    once there is space again the kept rows are written, each once."""
    result = _child(FILL + '''
import json
from lit_rlvr.run.csv_logger import CSVLogger
from lit_rlvr.config.errors import StorageError
logger = CSVLogger(str(DISK), name="", version="")
logger.log_metrics({"a": 1.0}, step=0)
logger.save()
before = (DISK / "metrics.csv").read_text()
fill()
errors = []
for step, metrics in enumerate(({"a": 2.0, "b": 3.0}, {"a": 4.0, "b": 5.0}), 1):  # a new column, an append
    logger.log_metrics(metrics, step=step)
    try:
        logger.save()
    except StorageError as err:
        errors.append(str(err))
    errors.append((DISK / "metrics.csv").read_text() == before)
free()
logger.save()
print(json.dumps({"errors": errors, "after": (DISK / "metrics.csv").read_text()}))
''', tmp_path / "disk", 512)
    first, same_1, second, same_2 = result["errors"]
    assert same_1 and same_2, result
    for message in (first, second):
        assert "No space left on device" in message and str(tmp_path / "disk" / "metrics.csv") in message
    assert result["after"].splitlines() == ["a,b,step", "1.0,,0", "2.0,3.0,1", "4.0,5.0,2"]


@needs_namespaces
def test_completions_summary_and_eval_files_on_a_full_disk(tmp_path):
    """completions.jsonl (appended), summary.json and eval.json (replaced whole): one line each, nothing lost."""
    result = _child(FILL + '''
import json
from lit_rlvr.config.errors import StorageError
from lit_rlvr.run.storage import append_text, write_atomic
append_text(DISK / "completions.jsonl", '{"step": 0}\\n', "the completions log")
write_atomic(DISK / "summary.json", '{"steps": 1}', "the run summary")
fill()
messages = []
for write in (lambda: append_text(DISK / "completions.jsonl", '{"step": 1, "x": "' + "y" * 9000 + '"}\\n',
                                  "the completions log"),
              lambda: write_atomic(DISK / "summary.json", '{"steps": 2, "pad": "' + "z" * 9000 + '"}',
                                   "the run summary")):
    try:
        write()
    except StorageError as err:
        messages.append(str(err))
print(json.dumps({"messages": messages, "completions": (DISK / "completions.jsonl").read_text(),
                  "summary": (DISK / "summary.json").read_text(),
                  "files": sorted(p.name for p in DISK.iterdir())}))
''', tmp_path / "disk", 256)
    assert len(result["messages"]) == 2
    for message, name in zip(result["messages"], ["completions.jsonl", "summary.json"]):
        assert "No space left on device" in message and name in message and "needs ~9.0 kB" in message, message
    assert result["completions"] == '{"step": 0}\n' and result["summary"] == '{"steps": 1}'
    assert result["files"] == ["completions.jsonl", "filler", "summary.json"]  # no temp file left


@needs_namespaces
def test_warmup_cache_entry_on_a_full_disk_is_absent_not_half_written(tmp_path):
    result = _child('''
import json
from lit_rlvr.run import cache_entry
from lit_rlvr.config.errors import StorageError
entry = DISK / "tiny-abc"
def fill(folder):
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\\0" * 300_000)  # 300 kB on a 128 kB disk
try:
    cache_entry.write_entry(entry, fill, needed=300_000, cache_dir=str(DISK))
    message = None
except StorageError as err:
    message = str(err)
print(json.dumps({"message": message, "left": sorted(p.name for p in DISK.iterdir())}))
''', tmp_path / "disk", 128)
    assert "No space left on device" in result["message"] and "tiny-abc" in result["message"], result
    assert "needs ~300.0 kB" in result["message"] and result["left"] == []  # no entry, no temp folder
    report(fault="disk full: metrics/completions/summary/cache", bad_inputs=6, survived=False,
           stopped_cleanly=True, data_lost=0)


def _train(run_dir: Path, *overrides: str, tmpfs=None, read_only=(), fill=None, entry="train.py"):
    command = [sys.executable, "train.py"] if entry == "train.py" else [sys.executable, "-m", "lit_rlvr.app.entry"]
    args = [*command, *SMALL, f"hydra.run.dir={run_dir}", *overrides]
    if tmpfs is None and not read_only:
        return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900)
    return full_disk.run(args, tmpfs=tmpfs, read_only=read_only, fill=fill, cwd=REPO)


def _one_line(done: subprocess.CompletedProcess, label: str = "error") -> str:
    """The run's stderr ends in the line and the hint to LIT_RLVR_DEBUG, without a traceback."""
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out, out[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == "(set LIT_RLVR_DEBUG=1 for the traceback)" and lines[-2].startswith(f"{label}: "), lines[-5:]
    return lines[-2]


LOOK = """
import json, sys, torch
from pathlib import Path
run = Path(sys.argv[1])
state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
rows = [line for line in (run / "metrics.csv").read_text().splitlines()[1:] if line]
print("LOOK " + json.dumps({"step": state["global_step"], "rows": len(rows),
                            "files": sorted(p.name for p in (run / "checkpoints").iterdir())}))
"""


def _look(done: subprocess.CompletedProcess) -> dict:
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("LOOK "))[5:])


@needs_namespaces
def test_train_py_on_a_full_disk_ends_in_one_line_with_the_last_checkpoint_intact(tmp_path):
    """The tiny run's checkpoint is ~1.3 MB: on a 2 MB disk the first save fits and the second (old and new
    side by side) does not."""
    disk = tmp_path / "disk"
    done = full_disk.run([sys.executable, "train.py", *SMALL, f"hydra.run.dir={disk / 'run'}", "trainer.max_steps=3"],
                         tmpfs=(disk, 2000), then=[sys.executable, "-c", LOOK, disk / "run"], cwd=REPO)
    line = _one_line(done)
    last = disk / "run" / "checkpoints" / "last.ckpt"
    assert f"cannot write the checkpoint {last}: No space left on device (needs ~1.3 MB" in line, line
    assert f"resume={last}" in line
    kept = _look(done)  # what the run left on its full disk
    assert kept["step"] == 1 and kept["files"] == ["last.ckpt"] and kept["rows"] >= 1, kept
    report(fault="train.py: disk full at a checkpoint", bad_inputs=1, survived=False, stopped_cleanly=True,
           data_lost=0)


# -- class 8: a run directory that cannot be written is one line, before Hydra logs into it ---------------------
def _run_dir_case(kind: str, tmp_path: Path) -> tuple[Path, dict, str]:
    """(hydra.run.dir, how to run it, what the line must say)."""
    ro, afile = tmp_path / "ro", tmp_path / "a_file"
    (ro / "run").mkdir(parents=True)
    afile.write_text("not a directory")
    return {
        "existing read-only": (ro / "run", {"read_only": [ro]}, f"cannot write the run directory {ro / 'run'}: "
                                                              "Read-only file system"),
        "new under read-only": (ro / "new" / "run", {"read_only": [ro]}, "Read-only file system"),
        "a file": (afile, {}, f"hydra.run.dir='{afile}': {afile} is a file, not a directory"),
        "under a file": (afile / "run", {}, f"{afile} is a file, not a directory"),
        "full disk": (tmp_path / "disk" / "run", {"tmpfs": (tmp_path / "disk", 256), "fill": (tmp_path / "disk", 240)},
                      "No space left on device"),
    }[kind]


RUN_DIRS = ["existing read-only", "new under read-only", "a file", "under a file", "full disk"]


def test_unwritable_run_dirs_are_one_line_naming_hydra_run_dir(tmp_path):
    if not full_disk.namespaces_work():
        pytest.skip("no user namespaces (unshare -Urm)")
    cases = {kind: _run_dir_case(kind, tmp_path / kind.replace(" ", "_")) for kind in RUN_DIRS}
    # each fails within seconds (before any model, data or Hydra log file), most of them importing: side by side
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = {kind: pool.submit(_train, run_dir, "trainer.max_steps=1", **how)
                for kind, (run_dir, how, _) in cases.items()}
        packaged = pool.submit(_train, *_run_dir_case("existing read-only", tmp_path / "again")[:1],
                               "trainer.max_steps=1", read_only=[tmp_path / "again" / "ro"],
                               entry="lit-rlvr-train")  # the packaged entry: the same
    lines = {}
    for kind, (_, _, expected) in cases.items():
        lines[kind] = _one_line(runs[kind].result(), "config error" if "file" in kind else "error")
        assert expected in lines[kind] and "hydra.run.dir" in lines[kind], (kind, lines[kind])
    assert "needs ~65.5 kB" in lines["full disk"]
    assert "Read-only file system" in _one_line(packaged.result())
    report(fault="unwritable run dir (5 kinds)", bad_inputs=len(RUN_DIRS) + 1, survived=False,
           stopped_cleanly=True, data_lost=0)


@needs_namespaces
def test_cli_with_a_read_only_log_dir_is_one_line(tmp_path):
    (tmp_path / "ro").mkdir()
    config = str(REPO / "conf/cli/tiny_grpo.yaml")
    done = full_disk.run([sys.executable, "-m", "lit_rlvr.app.cli", "fit", "--config", config,
                          "--trainer.max_steps", "1", "--trainer.logger.init_args.save_dir", str(tmp_path / "ro")],
                         read_only=[tmp_path / "ro"], cwd=REPO)
    line = _one_line(done)
    assert "Read-only file system" in line and str(tmp_path / "ro") in line, line
