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
- The child runs in a session of its own (a terminal's Ctrl-C reaches the trainer only, which stops the run), has
  the trainer's torch thread count, and ends on `shutdown` or when the socket closes (the trainer's process
  ended, even by SIGKILL). When the child dies, each waiting and later call raises `EngineError`.
- A call waiting for the child honours a stop request past its grace (`STOP.check()`), as the decode loop does in
  one process; the child's generation is then left to finish on its own.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lit_rlvr.rollout.engine import Completion, EngineError, RolloutEngine, SamplingParams
from lit_rlvr.run.stop import STOP

POLL_S = 0.2  # how often a waiting call looks at stop requests
# what the child's engine is, copied onto this proxy once it is built (the contract's capability attributes)
CAPABILITIES = ("bucket_bytes", "weight_dtype", "lora_sync", "serves_lora", "adapter_base_by_name", "swaps_in_flight",
                "max_lora_rank")
Packed = tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict[torch.dtype, Tensor]]


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
    tagged = bool(flat) and flat[0].versions is not None

    def cat(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
        return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)

    return ([len(c) for c in per_prompt], [(len(c.token_ids), c.finish_reason) for c in flat],
            cat([c.token_ids for c in flat], torch.long), cat([c.logprobs for c in flat], torch.float),
            cat([c.versions for c in flat], torch.long) if tagged else None)


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
        self._process = subprocess.Popen(
            [sys.executable, "-m", "lit_rlvr.rollout.hf_process", "--fd", str(there.fileno()),
             "--threads", str(torch.get_num_threads())], pass_fds=(there.fileno(),), start_new_session=True)
        there.close()
        self._conn = Connection(os.dup(here.fileno()))
        self._lock = threading.Lock()  # one sender at a time; the table of waiting calls
        self._waiting: dict[int, Future] = {}
        self._ids = itertools.count()
        self._exited: Optional[str] = None  # why the child is gone, once it is
        reader = threading.Thread(target=self._read, name="hf-engine-replies", daemon=True)
        reader.start()
        # at shutdown, garbage collection or the interpreter's exit: no thread of ours outlives it
        self._closer = weakref.finalize(self, _end, self._process, here, self._conn, reader)
        try:
            built = self._call("start", payload, {"pad_id": pad_id, "eos_id": eos_id, **options, "mode": "copy"})
        except BaseException:
            self.shutdown()
            raise
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
            if self._exited is None:
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
        if self._exited is None and self._process.poll() is None:
            try:
                self._call("shutdown")
            except (EngineError, OSError):
                pass
        self._closer()

    def engine_pids(self) -> list[int]:
        """The engine's process (e.g. to pin it to cores: `os.sched_setaffinity`)."""
        return [self._process.pid]

    # -- the socket ------------------------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` in the child, in this thread's own thread there; its value, or its exception."""
        done: Future = Future()
        with self._lock:
            if self._exited is not None:
                raise EngineError(self._exited)
            call = next(self._ids)
            data = pickle.dumps((call, threading.get_ident(), method, args), protocol=pickle.HIGHEST_PROTOCOL)
            self._waiting[call] = done
            try:
                self._conn.send_bytes(data)
            except OSError as err:
                del self._waiting[call]
                raise EngineError(f"the HF engine's process does not take calls ({err})") from err
        while True:
            try:
                ok, value = done.result(timeout=POLL_S)
                break
            except FutureTimeout:
                STOP.check()  # a stop request past its grace abandons the call (the child's answer is dropped)
        if not ok:
            raise value
        return value

    def _read(self) -> None:
        """The replies, each to its waiting call; once the socket closes every waiting call fails naming the exit."""
        try:
            while True:
                call, ok, value = pickle.loads(self._conn.recv_bytes())
                with self._lock:
                    done = self._waiting.pop(call, None)
                if done is not None:
                    done.set_result((ok, value))
        except (EOFError, OSError):
            pass
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        with self._lock:
            self._exited = (f"the HF engine's process (pid {self._process.pid}) exited with code {code}"
                            if code is not None else f"the HF engine's process (pid {self._process.pid}) closed its "
                            "socket")
            waiting, self._waiting = self._waiting, {}
        for done in waiting.values():
            done.set_result((False, EngineError(self._exited)))


def _end(process: subprocess.Popen, sock: socket.socket, conn: Connection, reader: threading.Thread) -> None:
    """Shut the socket both ways (the child reads its end and ends; the reply reader wakes up and ends), make sure
    the child is gone, and wait for the reader before closing."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already shut
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if reader is not threading.current_thread():
        reader.join(timeout=10)
    conn.close()
    sock.close()


# -- the child ---------------------------------------------------------------------------------------------------
def _serve(conn: Connection) -> None:
    """Take calls until `shutdown` or the socket closes: `start` builds the engine here; every other call runs in
    the thread that stands for its caller's thread."""
    from lit_rlvr.rollout.hf import HFEngine

    send = threading.Lock()

    def reply(call: int, ok: bool, value: Any) -> None:
        data = pickle.dumps((call, ok, value if ok else _portable(value)), protocol=pickle.HIGHEST_PROTOCOL)
        with send:
            conn.send_bytes(data)

    engine, workers = None, {}
    while True:
        try:
            call, thread, method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if method == "shutdown":
            reply(call, True, None)
            return
        if method == "start":
            try:
                payload, options = args
                engine = HFEngine(pickle.loads(payload), **options)
                built = {name: getattr(engine, name) for name in CAPABILITIES}
                reply(call, True, {**built, "generation_dtype": engine.generation_dtype()})
            except BaseException as err:
                reply(call, False, err)
            continue
        if thread not in workers:
            workers[thread] = queue.SimpleQueue()
            threading.Thread(target=_work, args=(engine, workers[thread], reply), daemon=True).start()
        workers[thread].put((call, method, args))


def _work(engine, calls: queue.SimpleQueue, reply) -> None:
    """One caller thread's calls, in order; its pushes (`push_begin` .. `push_end`) stay open across calls."""
    pushes: list = []
    while True:
        call, method, args = calls.get()
        try:
            value = _run(engine, pushes, method, args)
        except BaseException as err:
            reply(call, False, err)
        else:
            reply(call, True, value)


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
    torch.set_num_threads(args.threads)
    _serve(Connection(args.fd))


if __name__ == "__main__":
    main()
