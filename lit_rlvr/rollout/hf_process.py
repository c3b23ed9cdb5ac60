"""`HFProcessEngine`: the HF engine in a process of its own (`engine=hf engine.options.process=true`).

With `rollout.mode=async` the producer generates while the trainer updates. In one process both share Python's
GIL, and the HF decode loop holds it between its kernels, so on a CPU the overlap stays partial. Here a `copy`
`HFEngine` runs in a child process with an interpreter of its own, and this class forwards the engine contract to
it over a socket, so that generation and the update really run at once (as SGLang's and vLLM's processes do).

- Each calling thread keeps its own thread in the child, which runs its calls in order. A push made while the
  producer's generation runs (`push_in_flight`) is staged by the child's engine and lands between two decode
  steps, exactly as it does in one process.
- What crosses the socket is a copy: the model once, at start; each pushed bucket as one flat tensor per dtype;
  a generation's completions as flat tensors. The trainer may change its tensors as soon as a call returns.
- The child ignores SIGINT and SIGTERM and runs in a session of its own: a terminal's Ctrl-C, or a SIGTERM sent to
  every process of a job (SLURM, systemd), stops the run through the trainer, which saves as usual. It has the
  trainer's torch thread count and `sys.path`, and ends at `shutdown`, when the engine is garbage collected, or when
  the socket closes (the trainer's process ended, even by SIGKILL). When the child dies, each waiting and later
  call raises `EngineError`; an error raised in the child comes back as itself, with the child's traceback as a note.
- A call waiting for the child honours a stop request past its grace (`STOP.check()`), as the decode loop does in
  one process: the call is abandoned and the child is killed with it (it may hold a push half made, or be frozen), so
  any later call raises `EngineError` rather than wait. Calls are written to the socket by a thread of their own: a
  child that reads nothing blocks that thread's write, never a caller's wait.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from lit_rlvr.config.errors import StopRequested
from lit_rlvr.rollout.engine import Completion, EngineError, RolloutEngine, SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.run.stop import STOP, STOP_POLL_S

START_TIMEOUT_S = 600.0  # the child imports torch, unpickles the policy and copies it
# The child's program. When scipy is installed, transformers imports it at start for its object-detection losses,
# which an engine never computes: 36 MB of the child's RSS (a third of what transformers adds to torch). Unless
# something loaded it already, it is marked absent only while lit-rlvr and transformers load: a policy's own
# `import scipy` still works, but transformers' `is_scipy_available()` stays false in this process.
CHILD_PROGRAM = ("import sys; hide = 'scipy' not in sys.modules; hide and sys.modules.update(scipy=None); "
                 "from lit_rlvr.rollout.hf_process import main; hide and sys.modules.pop('scipy'); main()")
# glibc's allocator in the child: blocks of 4 MiB or more are mapped, and returned to the system when freed. By
# default its threshold rises to the largest mapped block freed so far (up to 32 MiB), after which each generation's
# KV buffers (8.3 MB a layer's keys on the long workload) are carved from the heap and fragment it: the engine's peak
# RSS was 461-485 MB by default, 427 MB with this (bench/async_overlap.py). 4 MiB stays above a decode step's
# activations (64 rows of a 7B model's MLP: 2.8 MB), which a lower threshold would map and zero at every step: at
# 128 KiB (413 MB) generation ran 8-17 % slower. A non-empty value in the user's environment wins.
ENGINE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)}
# what the child's engine is, copied onto this proxy once it is built (the contract's capability attributes)
CAPABILITIES = ("bucket_bytes", "weight_dtype", "lora_sync", "serves_lora", "adapter_base_by_name", "swaps_in_flight",
                "max_lora_rank")
Packed = tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict[torch.dtype, Tensor]]


def child_environment(environ: Mapping[str, str], path: Sequence[str]) -> dict[str, str]:
    """The engine process's environment: `environ`, `ENGINE_MALLOC` where `environ` leaves it unset or empty, and
    `path` (this process's `sys.path`) as its PYTHONPATH, so that it imports the modules this one does."""
    return {**environ, **{k: v for k, v in ENGINE_MALLOC.items() if not environ.get(k)},
            "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def pack_tensors(named: Iterable[tuple[str, Tensor]]) -> Packed:
    """Named tensors -> (name, shape, dtype of each, in order; one flat CPU copy per dtype): one buffer to send."""
    index, parts = [], {}
    for name, tensor in named:
        index.append((name, tuple(tensor.shape), tensor.dtype))
        parts.setdefault(tensor.dtype, []).append(tensor.detach().reshape(-1).cpu())
    return index, {dtype: torch.cat(flat) for dtype, flat in parts.items()}  # cat copies: the caller's stay its own


def unpack_tensors(index: list[tuple[str, tuple[int, ...], torch.dtype]],
                   flats: dict[torch.dtype, Tensor]) -> list[tuple[str, Tensor]]:
    """The inverse of `pack_tensors`: views of the flat buffers."""
    offsets = dict.fromkeys(flats, 0)
    out = []
    for name, shape, dtype in index:
        size = math.prod(shape)
        out.append((name, flats[dtype][offsets[dtype]:offsets[dtype] + size].view(shape)))
        offsets[dtype] += size
    return out


def pack_completions(per_prompt: list[list[Completion]]) -> tuple:
    """Completions per prompt -> (counts per prompt, length and finish reason of each, flat token ids, log-probs,
    versions or None): five objects to send whatever their number."""
    flat = [c for completions in per_prompt for c in completions]
    tagged = any(c.versions is not None for c in flat)  # (a first push may land between two row batches)

    def cat(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
        return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)

    return ([len(c) for c in per_prompt], [(len(c.token_ids), c.finish_reason) for c in flat],
            cat([c.token_ids for c in flat], torch.long), cat([c.logprobs for c in flat], torch.float),
            cat([c.versions if c.versions is not None else torch.full_like(c.token_ids, -1) for c in flat], torch.long)
            if tagged else None)


def unpack_completions(counts: list[int], rows: list[tuple[int, str]], tokens: Tensor, logprobs: Tensor,
                       versions: Optional[Tensor]) -> list[list[Completion]]:
    """The inverse of `pack_completions`."""
    flat, start = [], 0
    for length, reason in rows:
        piece = slice(start, start + length)
        flat.append(Completion(tokens[piece], logprobs[piece], reason,
                               versions=None if versions is None else versions[piece]))
        start += length
    out, start = [], 0
    for n in counts:
        out.append(flat[start:start + n])
        start += n
    return out


def _portable(err: BaseException) -> BaseException:
    """`err` if it survives pickling as itself, else a RuntimeError that names it."""
    try:
        back = pickle.loads(pickle.dumps(err))
        if type(back) is type(err) and str(back) == str(err):
            return err
    except Exception:  # an exception class whose arguments do not pickle back
        pass
    return RuntimeError(f"{type(err).__name__}: {err}")


class _Channel:
    """The trainer's end of the socket: the calls waiting for a reply, and why the child is gone once it is. Apart
    from the engine, so that the reply reader holds no reference to it (the engine is then garbage collected)."""

    def __init__(self, conn: Connection, process: subprocess.Popen):
        self.conn, self.process = conn, process
        self.lock = threading.Lock()  # the order of the calls sent; the table of waiting calls
        self.waiting: dict[int, Future] = {}
        self.ids = itertools.count()
        self.exited: Optional[str] = None
        # the calls to send, in order, written by `_send`: a child that does not read (frozen, SIGSTOPped) blocks that
        # thread's write once the socket's buffer is full, never a caller, which keeps looking at stop requests
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()

    def fail(self, reason: str) -> None:
        """The child is gone (or given up): every waiting and later call raises `EngineError(reason)`."""
        with self.lock:
            self.exited = self.exited or reason
            waiting, self.waiting = self.waiting, {}
        for done in waiting.values():
            done.set_result((False, EngineError(self.exited), ""))


def _send(channel: _Channel) -> None:
    """Write the calls of `channel.outbox` to the socket, in order, until None; a write that fails (the child gone,
    the socket shut) fails every waiting and later call."""
    while (data := channel.outbox.get()) is not None:
        try:
            channel.conn.send_bytes(data)
        except OSError as err:
            channel.fail(f"the HF engine's process does not take calls ({err})")
            return


def _read(channel: _Channel) -> None:
    """The replies, each to its waiting call; once the socket closes (or a reply cannot be read) every waiting
    call fails naming the child's exit."""
    try:
        while True:
            call, ok, value, trace = pickle.loads(channel.conn.recv_bytes())
            with channel.lock:
                done = channel.waiting.pop(call, None)
            if done is not None:
                done.set_result((ok, value, trace))
    except BaseException as err:  # EOF or a closed socket, or a reply that does not unpickle
        unreadable = not isinstance(err, (EOFError, OSError))
    if unreadable:
        channel.process.kill()
    try:
        code = channel.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = None
    pid = channel.process.pid
    channel.fail(f"the HF engine's process (pid {pid}) exited with code {code}" if code is not None else
                 f"the HF engine's process (pid {pid}) closed its socket")


class HFProcessEngine(RolloutEngine):
    """The engine contract, forwarded to a `copy` `HFEngine` in a child process (see the module docstring).

    `options` are `HFEngine`'s (`mode` null or `copy`: the child keeps its own copy of the weights)."""

    def __init__(self, model: nn.Module, *, pad_id: int, eos_id: int, **options: Any):
        if options.get("mode") not in (None, "copy"):
            raise ValueError(f"engine.options.process=true with engine.options.mode={options['mode']!r}: an engine in "
                             "its own process has its own copy of the weights; set engine.options.mode=copy or null")
        try:
            payload = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # e.g. a module with a hook that does not pickle
            raise ValueError(f"engine.options.process=true: the policy ({type(model).__name__}) does not pickle, so "
                             f"it cannot be sent to the engine's process ({type(err).__name__}: {err}); set "
                             "engine.options.process=false") from err
        here, there = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD_PROGRAM, "--fd", str(there.fileno()),
             "--threads", str(torch.get_num_threads())], pass_fds=(there.fileno(),), start_new_session=True,
            env=child_environment(os.environ, sys.path))
        there.close()
        self._channel = _Channel(Connection(os.dup(here.fileno())), process)
        self._thread_key = threading.local()  # a token per calling thread (thread ids are reused)
        self._keys = itertools.count()
        reader = threading.Thread(target=_read, args=(self._channel,), name="hf-engine-replies", daemon=True)
        sender = threading.Thread(target=_send, args=(self._channel,), name="hf-engine-calls", daemon=True)
        reader.start()
        sender.start()
        # at shutdown, garbage collection or the interpreter's exit: the child ends, no thread of ours outlives it
        self._closer = weakref.finalize(self, _end, process, here, self._channel, reader, sender)
        try:
            built = self._call("start", payload, {"pad_id": pad_id, "eos_id": eos_id, **options, "mode": "copy"},
                               timeout_s=START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        del payload
        for name in CAPABILITIES:
            setattr(self, name, built[name])
        self._generation_dtype = built["generation_dtype"]

    # -- the contract ----------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int],
                 params: SamplingParams) -> list[list[Completion]]:
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        return unpack_completions(*self._call("generate", prompts, [int(n) for n in n_per_prompt], params))

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self._call("load_weights", *pack_tensors(named_tensors))

    def load_adapter(self, name: str, tensors: dict[str, Tensor], config: dict, activate: bool = True) -> None:
        self._call("load_adapter", name, *pack_tensors(tensors.items()), config, activate)

    @contextmanager
    def push_in_flight(self, tag: int, *, recompute_kv: bool = False) -> Iterator[None]:
        self._call("push_begin", tag, recompute_kv)
        try:
            yield
        except BaseException:
            if self._channel.exited is None:
                self._call("push_end", True)  # a failed push lands nothing
            raise
        self._call("push_end", False)

    def end_weight_update(self) -> None:
        self._call("end_weight_update")

    def to(self, device: torch.device) -> "HFProcessEngine":
        self._call("to", str(device))
        return self

    def generation_dtype(self) -> Optional[torch.dtype]:
        return self._generation_dtype

    def shutdown(self) -> None:
        self._closer()  # the socket shut both ways: the child reads its end and ends

    def engine_pids(self) -> list[int]:
        """The engine's process (e.g. to pin it to cores: `os.sched_setaffinity`)."""
        return [self._channel.process.pid]

    # -- the socket ------------------------------------------------------------------------------------------
    def _call(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        """Run `method(*args)` in the child, in this thread's own thread there; its value, or its exception."""
        channel, done = self._channel, Future()
        key = getattr(self._thread_key, "key", None)
        if key is None:
            key = self._thread_key.key = next(self._keys)
        with channel.lock:
            if channel.exited is not None:
                raise EngineError(channel.exited)
            call = next(channel.ids)
            channel.waiting[call] = done
            channel.outbox.put(pickle.dumps((call, key, method, args), protocol=pickle.HIGHEST_PROTOCOL))
        waited = 0.0
        while True:
            try:
                ok, value, trace = done.result(timeout=STOP_POLL_S)
                break
            except FutureTimeout:
                waited += STOP_POLL_S
                try:
                    STOP.check()
                except StopRequested:  # abandoned: the child may hold a push half made (or be frozen): it ends now
                    channel.fail(f"the HF engine's process was ended when a stop request abandoned its {method}")
                    channel.process.kill()
                    self._closer()
                    raise
                if timeout_s is not None and waited >= timeout_s:
                    channel.fail(f"the HF engine's process did not answer {method} within {timeout_s:g} s")
                    channel.process.kill()
                    self._closer()
        if not ok:
            if trace and hasattr(value, "add_note"):  # (Python >= 3.11)
                value.add_note(f"raised in the HF engine's process:\n{trace.rstrip()}")
            raise value
        return value


def _end(process: subprocess.Popen, sock: socket.socket, channel: _Channel, reader: threading.Thread,
         sender: threading.Thread) -> None:
    """Shut the socket both ways (the child reads its end and ends; the reply reader wakes up and ends; a write
    under way fails), make sure the child is gone, and wait for both threads before closing."""
    channel.outbox.put(None)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already shut
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for thread in (reader, sender):
        if thread is not threading.current_thread():
            thread.join(timeout=10)
    channel.conn.close()
    sock.close()


# -- the child ---------------------------------------------------------------------------------------------------
def _serve(conn: Connection) -> None:
    """Take calls until the socket closes: `start` builds the engine here; every other call runs in the thread
    that stands for its caller's thread."""
    send = threading.Lock()

    def reply(call: int, ok: bool, value: Any) -> None:
        trace = "" if ok else "".join(traceback.format_exception(value))
        try:
            data = pickle.dumps((call, ok, value if ok else _portable(value), trace), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # a value that does not pickle: its caller gets the reason, not silence
            data = pickle.dumps((call, False, RuntimeError(f"the HF engine's reply does not pickle: {err}"), ""))
        with send:
            conn.send_bytes(data)

    engine, workers = None, {}
    while True:
        try:
            call, thread, method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if method == "start":
            engine = _start(call, args, reply)
            del args
            continue
        if thread not in workers:
            workers[thread] = queue.SimpleQueue()
            threading.Thread(target=_work, args=(engine, workers[thread], reply), daemon=True).start()
        workers[thread].put((call, method, args))


def _start(call: int, args: tuple, reply) -> Any:
    """Build the engine from the pickled policy (which is dropped once copied); reply with what it is."""
    payload, options = args
    try:
        try:
            model = pickle.loads(payload)
        except Exception as err:  # e.g. a class defined in a script's __main__
            raise ValueError(f"the engine's process cannot rebuild the policy ({type(err).__name__}: {err}); set "
                             "engine.options.process=false") from err
        del payload
        engine = HFEngine(model, **options)
        del model
        reply(call, True, {**{name: getattr(engine, name) for name in CAPABILITIES},
                           "generation_dtype": engine.generation_dtype()})
        return engine
    except BaseException as err:
        reply(call, False, err)
        return None


def _work(engine, calls: queue.SimpleQueue, reply) -> None:
    """One caller thread's calls, in order; its pushes (`push_begin` .. `push_end`) stay open across calls."""
    pushes: list = []
    while True:
        call, method, args = calls.get()
        try:
            value, ok = _run(engine, pushes, method, args), True
        except BaseException as err:
            value, ok = err, False
        reply(call, ok, value)


def _run(engine, pushes: list, method: str, args: tuple) -> Any:
    if method == "generate":
        return pack_completions(engine.generate(*args))
    if method == "load_weights":
        return engine.load_weights(unpack_tensors(*args))
    if method == "load_adapter":
        name, index, flats, config, activate = args
        return engine.load_adapter(name, dict(unpack_tensors(index, flats)), config, activate)
    if method == "push_begin":
        tag, recompute_kv = args
        push = engine.push_in_flight(tag, recompute_kv=recompute_kv)
        push.__enter__()
        pushes.append(push)
        return None
    if method == "push_end":
        (failed,) = args
        push = pushes.pop()
        if failed:
            failure = EngineError("the push failed in the trainer's process")
            push.__exit__(EngineError, failure, None)
        else:
            push.__exit__(None, None, None)
        return None
    if method == "end_weight_update":
        return engine.end_weight_update()
    if method == "to":
        engine.to(torch.device(args[0]))
        return None
    if method == "state":  # tests: whether a generation runs, and the tag of the weights held
        return {"generating": engine._generating, "tag": engine._tag}
    raise ValueError(f"the HF engine's process has no call {method!r}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="lit-rlvr's HF engine process (started by HFProcessEngine)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    for name in (signal.SIGINT, signal.SIGTERM):  # the trainer decides when to stop; the socket's end ends this
        signal.signal(name, signal.SIG_IGN)
    torch.set_num_threads(args.threads)
    _serve(Connection(args.fd))
