"""A stop request (SIGTERM) honoured within `stop_grace_s` whatever the trainer waits on (issue 61, class 4): here the
HF engine's own process, frozen by SIGSTOP, in a synchronous run (the trainer waits in the push it writes to the
frozen child) and in an asynchronous one (the producer's batch and the engine between batches). Each is a
`python train.py` run; they start together when this module starts. The run exits 0 naming the intact `last.ckpt`
(docs/reliability.md), and the frozen child is ended with it. (The pipeline's and the engine proxy's waits alone:
tests/test_rollout_pipeline.py, tests/test_hf_process.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 2
SMALL = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
         "algorithm.group_size=4", "checkpoint_every=1", "trainer.max_steps=100", f"stop_grace_s={GRACE_S}",
         "engine.options.process=true"]
MODES = {"sync": [], "async": ["rollout.mode=async", "rollout.max_staleness=1"]}
# after the SIGTERM: the grace, the abandoned step's way out, writing the summary and the interpreter's exit on a
# loaded 2-core machine; a wait that ignores the request never ends
EXIT_S = 60
ABANDON_S = 5  # from the grace's end to the abandoned step's line (a frozen child was waited for 10 s, then killed)


def engine_pid(pid: int) -> int | None:
    """The HF engine's process among `pid`'s children."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if b"lit_rlvr.rollout.hf_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
        except FileNotFoundError:
            continue
    return None


def alive(pid: int) -> bool:
    """Running or stopped; not gone, not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stops")
    procs = {}
    for name, extra in MODES.items():
        log = (root / f"{name}.log").open("w")
        procs[name] = (subprocess.Popen([sys.executable, "train.py", *SMALL, *extra, f"hydra.run.dir={root / name}"],
                                        cwd=REPO, stdout=log, stderr=subprocess.STDOUT), root / name)
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("mode", list(MODES))
def test_sigterm_with_a_frozen_engine_process_exits_naming_the_intact_checkpoint(runs, mode):
    proc, run_dir = runs[mode]
    saved = run_dir / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 600
    while not saved.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, run_dir.with_suffix(".log").read_text()[-3000:]
    child = engine_pid(proc.pid)
    assert child is not None
    os.kill(child, signal.SIGSTOP)  # frozen: reads nothing, answers nothing
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    t0, sent = time.monotonic(), datetime.now()
    try:
        rc = proc.wait(timeout=EXIT_S)
        assert not alive(child)  # the frozen child was ended with the run
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {EXIT_S} s after SIGTERM with stop_grace_s={GRACE_S}")
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
    log = run_dir.with_suffix(".log").read_text()
    assert rc == 0, log[-3000:]
    assert time.monotonic() - t0 >= GRACE_S
    assert f"more than stop_grace_s={GRACE_S}" in log and f"continue with resume={saved}" in log, log[-3000:]
    stamp = re.search(r"\[([\d-]+ [\d:]+,\d+)\]\[lit_rlvr.app.recipe\]\[WARNING\] - stopped: ", log).group(1)
    abandoned_s = (datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f") - sent).total_seconds()
    assert GRACE_S <= abandoned_s < GRACE_S + ABANDON_S, log[-3000:]
    assert torch.load(saved, map_location="cpu", weights_only=False)["global_step"] >= 0  # intact
