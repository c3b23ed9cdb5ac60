"""A stop request does not wait on a reward call that blocks (issue 61, class 4): a reward that sleeps an hour in C
code (no thread can cut it) with `+reward.options.timeout_s=60`, and SIGTERM once it blocks: `python train.py`
exits within `stop_grace_s` (plus the exit's own seconds), in sync and in async mode, naming the intact last.ckpt
and saving nothing of the abandoned step. Before, both runs were still going 100 s after the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 3
# 4 prompts x 4 samples = 16 reward calls a step: the reward blocks from the third step's first call on
OVERRIDES = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
             "algorithm.group_size=4", "checkpoint_every=1", "trainer.max_steps=50", f"stop_grace_s={GRACE_S}",
             "reward.name=tests.reward_helpers:blocking_reward", "+reward.options.timeout_s=60"]
MODES = {"sync": [], "async": ["rollout.mode=async"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two runs, started together (each ~1 min to its third step on a loaded 2-core machine)."""
    root = tmp_path_factory.mktemp("reward_stops")
    started = {}
    for mode, extra in MODES.items():
        run_dir, marker, log = root / mode, root / f"{mode}.blocked", root / f"{mode}.log"
        env = {**os.environ, "HANG_AFTER": "32", "HANG_MARKER": str(marker)}
        proc = subprocess.Popen([sys.executable, "train.py", *OVERRIDES, *extra, f"hydra.run.dir={run_dir}"],
                                cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        started[mode] = (proc, run_dir, marker, log)
    yield started
    for proc, *_ in started.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("mode", list(MODES))
def test_sigterm_while_a_reward_call_blocks_exits_within_the_grace_naming_the_intact_checkpoint(runs, mode):
    proc, run_dir, marker, log = runs[mode]
    deadline = time.monotonic() + 600  # the first run of a session may build the tiny model's warm-up
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), log.read_text()[-3000:]
    time.sleep(1.0)  # the call is under way, its 60 s timeout far off
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=GRACE_S + 45)  # the exit itself: the summary, the interpreter's teardown
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{mode}: still running {GRACE_S + 45} s after SIGTERM (stop_grace_s={GRACE_S})\n"
                    + log.read_text()[-3000:])
    took = time.monotonic() - signalled
    text = log.read_text()
    assert rc == 0 and took < GRACE_S + 45, text[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert f"resume={last}" in text and "stop_grace_s=3" in text, text[-3000:]
    saved = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert saved >= 1 and f"{last} holds step {saved}" in text, text[-3000:]
    assert not list(last.parent.glob("*.tmp*"))
