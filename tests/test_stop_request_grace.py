"""The stop request's grace period on a hand-set clock: a request is honoured (`StopRequested`) exactly when it has
waited `stop_grace_s`, never while unarmed; the first request is the one that counts; `stop_requests` records SIGTERM
and a first Ctrl-C, restores the handlers it replaced, and does nothing off the main thread."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from lit_rlvr.config.errors import StopRequested
from lit_rlvr.run import stop
from lit_rlvr.run.stop import STOP, StopFlag, stop_requests


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stop.time, "monotonic", lambda: now[0])
    return now


def test_a_request_is_honoured_exactly_at_the_grace_period(clock):
    flag = StopFlag()
    flag.arm(2.0)
    flag.check()  # no request: nothing
    assert not flag.requested
    flag.request("SIGTERM")
    assert flag.requested
    clock[0] = 101.5
    flag.request("SIGINT")  # a later request does not restart the clock or rename it
    clock[0] = 101.999
    flag.check()
    clock[0] = 102.0
    with pytest.raises(StopRequested, match=r"SIGTERM 2s ago, more than stop_grace_s=2: the step in progress"):
        flag.check()


def test_a_zero_grace_period_stops_at_the_next_check(clock):
    flag = StopFlag()
    flag.arm(0.0)
    flag.request("SIGTERM")
    with pytest.raises(StopRequested):
        flag.check()


def test_unarmed_requests_wait_for_the_steps_end(clock):
    flag = StopFlag()
    flag.request("SIGTERM")
    clock[0] = 1e9
    flag.check()
    assert flag.requested
    flag.arm(1.0)  # a new run forgets the old request
    assert not flag.requested and flag.name == ""
    flag.check()


def test_stop_requests_records_signals_and_restores_the_handlers(clock):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        with stop_requests(5.0):
            assert STOP.grace_s == 5.0 and not STOP.requested
            os.kill(os.getpid(), signal.SIGTERM)
            assert STOP.requested and STOP.name == "SIGTERM"
            clock[0] = 105.0
            with pytest.raises(StopRequested):
                STOP.check()
        assert STOP.grace_s is None and not STOP.requested
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
        with stop_requests(1.0):
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C is recorded ...
            assert STOP.name == "SIGINT"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # ... the second aborts at once
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    finally:
        STOP.arm(None)


def test_stop_requests_off_the_main_thread_changes_nothing():
    seen = []

    def body():
        handlers = signal.getsignal(signal.SIGTERM)
        with stop_requests(1.0):
            seen.append((signal.getsignal(signal.SIGTERM) is handlers, STOP.grace_s))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(30)
    assert seen == [(True, None)]
