"""bench/common.py's baton: trainers in separate processes take turns, `block` steps each, never at once.

Each check runs in a fresh interpreter: multiprocessing's spawn context starts a resource-tracker process that
lives as long as its parent, and other tests assert that the test process has no children left."""

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def _steps(name: str, count: int, baton) -> list[tuple[float, float, str]]:
    """A stand-in trainer: `count` steps of ~20 ms, each (start, end, name)."""
    baton.acquire(name, count=False)  # set-up waits for a turn too
    spans = []
    for _ in range(count):
        baton.acquire(name)
        start = time.perf_counter()
        time.sleep(0.02)
        spans.append((start, time.perf_counter(), name))
    return spans


def _fails(name: str, baton) -> None:
    baton.acquire(name)
    raise ValueError("boom")


def check_turns() -> None:
    import common

    baton = common.Baton(["a", "b"], block=2)
    values, errors = common.run_in_turns({"a": (_steps, ("a", 5)), "b": (_steps, ("b", 3))}, baton, threads=1)
    assert errors == {}, errors
    spans = sorted(values["a"] + values["b"])  # perf_counter is system-wide on Linux (CLOCK_MONOTONIC)
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:])), spans  # one step at a time
    order = "".join(name for *_, name in spans)
    assert order == "aabbaaba", order  # blocks of 2; after b's third step a finishes alone


def check_failure() -> None:
    import common

    baton = common.Baton(["bad", "good"])
    values, errors = common.run_in_turns({"bad": (_fails, ("bad",)), "good": (_steps, ("good", 3))}, baton,
                                         threads=1)
    assert "ValueError: boom" in errors["bad"], errors
    assert len(values["good"]) == 3, values


def _run(check: str) -> None:
    done = subprocess.run([sys.executable, __file__, check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_processes_take_turns_in_blocks_and_never_overlap():
    _run("check_turns")


def test_a_failing_participant_is_reported_and_the_other_finishes():
    _run("check_failure")


if __name__ == "__main__":
    globals()[sys.argv[1]]()


def test_step_recorder_times_ivon_noise_draws_per_step():
    """The recorder adds the time spent in an optimizer's `_standard_normal` (IVON's noise draws) to each step's
    row as noise_s, reset every step; the draws still return what the optimizer returns."""
    import common

    class Drawing:
        def _standard_normal(self, sample_index):
            time.sleep(0.01)
            return [sample_index]

    class Trainer:
        optimizers = [Drawing()]
        callback_metrics = {}

    recorder, trainer = common.StepRecorder("c3po"), Trainer()
    recorder.on_train_start(trainer, None)
    for draws in (2, 0):
        recorder.on_train_batch_start(trainer, None, None, 0)
        assert [trainer.optimizers[0]._standard_normal(j) for j in range(draws)] == [[j] for j in range(draws)]
        recorder.on_train_batch_end(trainer, None, None, None, 0)
    first, second = (row["noise_s"] for row in recorder.rows)
    assert 0.02 <= first < 0.2 and second < 0.005
    plain = common.StepRecorder("grpo")  # no optimizer with draws: no noise_s column
    plain.on_train_start(type("T", (), {"optimizers": [object()], "callback_metrics": {}})(), None)
    plain.on_train_batch_start(None, None, None, 0)
    plain.on_train_batch_end(type("T", (), {"callback_metrics": {}})(), None, None, None, 0)
    assert "noise_s" not in plain.rows[0]
