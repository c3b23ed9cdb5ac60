"""`HFProcessEngine` (`engine.options.process=true`): the HF engine in a process of its own samples what the
in-process `copy` engine samples, before and after a push; a push made while the child generates lands between two
decode steps (each token tagged with its weights' version); errors come back as themselves; a child that dies is
an `EngineError` for the calls that wait on it, not a hang. (Runs: tests/test_async_runs.py.)"""

import contextlib
import gc
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from lit_rlvr.config.errors import ConfigError, StopRequested
from lit_rlvr.models import load_policy
from lit_rlvr.rollout import build_engine
from lit_rlvr.rollout.engine import EngineError, SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.hf_process import (CHILD_PROGRAM, ENGINE_MALLOC, HFProcessEngine, child_environment,
                                         pack_tensors, unpack_tensors)
from lit_rlvr.run.processes import peak_rss_mb
from lit_rlvr.run.stop import STOP

PROMPTS = ["12+34=", "5+5=", "71-18="]


@pytest.fixture(scope="module")
def engines(tiny_path):
    model, tokenizer = load_policy(tiny_path)
    model.eval()
    child = build_engine("hf", model, tokenizer, {"process": True})
    local = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, mode="copy")
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    yield child, local, model, prompts
    child.shutdown()


def _same(a, b) -> bool:
    """Same tokens, finish reasons and versions; log-probs to rounding (two processes, one kernel path)."""
    a, b = sum(a, []), sum(b, [])
    return len(a) == len(b) and all(
        torch.equal(x.token_ids, y.token_ids) and x.finish_reason == y.finish_reason
        and torch.allclose(x.logprobs, y.logprobs, atol=1e-6, rtol=0) for x, y in zip(a, b))


def test_it_samples_what_the_in_process_copy_engine_samples_before_and_after_a_push(engines):
    child, local, model, prompts = engines
    assert isinstance(child, HFProcessEngine) and child.model is None and not child.shares_weights
    assert child.swaps_in_flight and child.generation_dtype() == torch.float32
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    assert _same(child.generate(prompts, [3, 0, 2], params), local.generate(prompts, [3, 0, 2], params))
    moved = [(name, p.detach() + 0.01 * torch.randn_like(p)) for name, p in model.named_parameters()]
    for engine in (child, local):
        for start in range(0, len(moved), 5):  # in buckets, as a push sends them
            engine.load_weights(moved[start:start + 5])
    after = child.generate(prompts, [3, 0, 2], params)
    assert _same(after, local.generate(prompts, [3, 0, 2], params))
    assert not _same(after, HFEngine(model, pad_id=0, eos_id=2, mode="copy").generate(prompts, [3, 0, 2], params))


def test_the_engine_process_leaves_out_scipy_sets_its_allocator_and_reports_its_own_peak_memory(engines):
    """transformers imports scipy when it is installed, for losses an engine never computes: the engine's process
    loads it only if the policy's own code does. Its allocator returns large blocks when freed, unless the user's
    environment says otherwise. Its peak RSS is its own (VmHWM), not the trainer's at its start.
    (Before test_a_child_that_dies_fails_the_waiting_and_later_calls, which kills the shared child.)"""
    (pid,) = engines[0].engine_pids()
    with open(f"/proc/{pid}/environ", "rb") as environ:
        variables = dict(v.split(b"=", 1) for v in environ.read().split(b"\0") if b"=" in v)
    (name, value), = ENGINE_MALLOC.items()
    assert variables[name.encode()] == (os.environ.get(name) or value).encode()
    assert child_environment({name: "65536", "HOME": "/h"}, ["/a", "", "/b"]) == {
        name: "65536", "HOME": "/h", "PYTHONPATH": os.pathsep.join(["/a", "/b"])}
    assert child_environment({}, [])[name] == child_environment({name: ""}, [])[name] == value
    with open(f"/proc/{pid}/maps") as maps:
        assert f"{os.sep}scipy{os.sep}" not in maps.read()
    assert 0 < peak_rss_mb(pid) < peak_rss_mb()  # this process holds more (pytest, two engines' models, torch)
    if importlib.util.find_spec("scipy") is not None:  # hidden while transformers loads, importable after
        probe = CHILD_PROGRAM.replace("main()", "import scipy, transformers.utils as u; print(u.is_scipy_available())")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False"


def test_a_push_made_while_it_generates_lands_between_two_decode_steps(engines):
    child, _, model, prompts = engines
    with child.push_in_flight(0):  # tag what it holds: version 0
        pass
    params = SamplingParams(temperature=1.0, max_new_tokens=300, seed=5, ignore_eos=True)
    out = {}
    generating = threading.Thread(target=lambda: out.setdefault("c", child.generate(prompts, [16, 16, 16], params)))
    generating.start()
    deadline = time.monotonic() + 120
    while not child._call("state")["generating"]:
        assert time.monotonic() < deadline and generating.is_alive(), "the child never started generating"
        time.sleep(0.01)
    with child.push_in_flight(1):  # staged in the child: the call returns while the generation goes on
        child.load_weights((name, p.detach() * 1.5) for name, p in model.named_parameters())
    assert child._call("state")["generating"]
    generating.join()
    for completion in sum(out["c"], []):
        versions = completion.versions.tolist()
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1, versions
    child.load_weights(model.named_parameters())  # back to the policy's weights for the other tests


def test_errors_come_back_as_themselves(engines):
    child, _, model, _ = engines
    with pytest.raises(KeyError, match="unknown parameter 'nope'") as caught:
        child.load_weights([("nope", torch.zeros(1))])
    assert any("raised in the HF engine's process" in note and "_load" in note for note in caught.value.__notes__)
    # an option the child's engine refuses comes back as the one-line ConfigError (pickled with its lines)
    line = "engine.options.max_batch=0 is not valid: expected an integer >= 1"
    sent = pickle.loads(pickle.dumps(ConfigError([line])))
    assert type(sent) is ConfigError and str(sent) == line and sent.problems == [line]
    with pytest.raises(ValueError, match="process=true with engine.options.mode='shared'"):
        HFProcessEngine(model, pad_id=0, eos_id=2, mode="shared")


def test_packed_tensors_are_copies_that_unpack_to_the_same_values():
    named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16)), ("c", torch.tensor(7.0))]
    index, flats = pack_tensors(named)
    assert len(flats) == 2  # one buffer per dtype
    named[0][1].add_(100)  # the caller's tensor changes after the call: the packed copy does not
    back = dict(unpack_tensors(index, flats))
    assert torch.equal(back["a"], torch.arange(6.0).view(2, 3)) and back["b"].dtype == torch.bfloat16
    assert back["c"].shape == () and float(back["c"]) == 7.0


def test_a_child_that_dies_fails_the_waiting_and_later_calls(engines):
    engine, _, model, _ = engines  # (the module's engine, last used here)
    params = SamplingParams(temperature=1.0, max_new_tokens=2000, seed=1, ignore_eos=True)
    failed = {}

    def generate():
        try:
            engine.generate([[5, 6, 7]], [64], params)
        except EngineError as err:
            failed["err"] = str(err)

    waiting = threading.Thread(target=generate)
    waiting.start()
    deadline = time.monotonic() + 120
    while not engine._call("state")["generating"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (pid,) = engine.engine_pids()
    os.kill(pid, signal.SIGTERM)  # a job's SIGTERM reaches every process: the trainer decides, the child goes on
    os.kill(pid, signal.SIGINT)
    assert engine._call("state")["generating"]
    os.kill(pid, signal.SIGKILL)
    waiting.join(timeout=30)
    assert not waiting.is_alive() and f"(pid {pid}) exited with code -9" in failed["err"]
    with pytest.raises(EngineError, match="exited with code -9"):
        engine.load_weights(model.named_parameters())


def test_an_engine_garbage_collected_ends_its_child(tiny_path):
    model, tokenizer = load_policy(tiny_path)
    engine = build_engine("hf", model, tokenizer, {"process": True})
    (pid,) = engine.engine_pids()
    del engine
    gc.collect()
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(pid, 0)


def test_a_frozen_child_does_not_defer_a_stop_request_past_its_grace(tiny_path):
    """Issue 61, class 4: a child that reads nothing (SIGSTOPped) fills the socket's buffer; a push larger than it
    must not block its caller in the write, which keeps looking at stop requests, gives up past the grace and ends
    the child (SIGKILL reaches a stopped process)."""
    model, tokenizer = load_policy(tiny_path)
    engine = build_engine("hf", model, tokenizer, {"process": True})
    (pid,) = engine.engine_pids()
    os.kill(pid, signal.SIGSTOP)
    raised = []

    def push():
        try:
            engine.load_weights([("big", torch.zeros(8 << 20))])  # 32 MB, far more than a socket's buffer
        except BaseException as err:
            raised.append(err)

    STOP.arm(0.5)
    try:
        STOP.request("SIGTERM")
        pushing = threading.Thread(target=push, daemon=True)
        pushing.start()
        pushing.join(timeout=10)  # (bounded: before the fix it waited in the write for ever)
        assert not pushing.is_alive() and len(raised) == 1 and isinstance(raised[0], StopRequested)
    finally:
        STOP.arm(None)
        with contextlib.suppress(ProcessLookupError):  # ended by the give-up
            os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineError, match="stop request"):
        engine.load_weights([("small", torch.zeros(1))])
    engine.shutdown()
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(pid, 0)
