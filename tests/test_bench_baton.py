"""bench/common.py's baton: trainers in separate processes take turns, `block` steps each, never at once."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import common  # noqa: E402


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


def test_processes_take_turns_in_blocks_and_never_overlap():
    baton = common.Baton(["a", "b"], block=2)
    values, errors = common.run_in_turns({"a": (_steps, ("a", 5)), "b": (_steps, ("b", 3))}, baton, threads=1)
    assert errors == {}
    spans = sorted(values["a"] + values["b"])  # perf_counter is system-wide on Linux (CLOCK_MONOTONIC)
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:]))  # one step at a time
    assert "".join(name for *_, name in spans) == "aabbaaba"  # blocks of 2; after b's third step a finishes alone


def test_a_failing_participant_is_reported_and_the_other_finishes():
    baton = common.Baton(["bad", "good"])
    values, errors = common.run_in_turns({"bad": (_fails, ("bad",)), "good": (_steps, ("good", 3))}, baton,
                                         threads=1)
    assert "ValueError: boom" in errors["bad"]
    assert len(values["good"]) == 3
