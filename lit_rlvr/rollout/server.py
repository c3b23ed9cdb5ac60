"""Rollout engines as servers (docs/scaling.md, "Rollout servers"): the part shared by `engine=vllm_server` and
`engine=sglang_server`.

A `ServerPool` spreads requests over one or many servers started outside the run (`lit-rlvr-serve`); a request whose
server stops answering (connection refused or reset, or no answer within the timeout) marks that server gone for the
rest of the run and goes to another one (`engine/requests_retried`); when none is left the run stops with an
`EngineError` naming every URL and why it was given up. `ServerEngine` is the `RolloutEngine` over a pool: each of
the trainer's weight buckets is written to a safetensors file as it comes (no copy kept: the write is the only copy
on the trainer's side), then after the last one each server takes the files through its engine's own update routes,
paused around the update. The files stay for the next push, which rewrites them in place (the same tensors in the
same order: a copy into pages already in memory, where a new file first allocates and zeroes every page); they are
removed with the engine. They are written to shared memory (/dev/shm) when it has room for two copies of the
weights, else to the system's temporary folder, unless `weight_dir` names one. Under several trainer ranks only rank
0 pushes (every rank gathers the weights, as the push is a collective there): the others write nothing, and wait for
rank 0's outcome (a broadcast: the barrier that keeps a rank from sampling before the servers hold the new weights,
and that stops every rank when the push failed). Every HTTP call goes through lit_rlvr/run/http.py's client: one
deadline per request, an answer of at most `max_response_bytes`, http(s) only, and no redirect followed (a 3xx is
refused in one line).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar
from urllib.parse import urlsplit

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from lit_rlvr.config.errors import ConfigError, HTTPRefusal
from lit_rlvr.rollout.engine import Completion, EngineError, RolloutEngine, SamplingParams, save_policy_config
from lit_rlvr.run.distributed import broadcast_object, rank
from lit_rlvr.run.http import HTTPClient, redact

T = TypeVar("T")
# an engine's answers: a batch of samples with a log-prob per token (SGLang: a prompt's whole group) is far below it
DEFAULT_MAX_RESPONSE_BYTES = 256 << 20


def gone(err: BaseException) -> bool:
    """Whether `err` says the server does not answer, or broke off its answer (refused or dropped connection, no
    whole answer in time); a 4xx/5xx, a redirect or an answer too large is the server answering."""
    return isinstance(err, HTTPRefusal) and err.kind in ("connection", "deadline")


def decoded(url: str, body: bytes) -> Any:
    """The JSON answer `body` of `url` (None for an empty body); a `RuntimeError` naming the URL when not JSON."""
    if not body:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as err:
        raise RuntimeError(f"{redact(url)} answered with a body that is not JSON: "
                           f"{body[:200].decode('utf-8', 'replace')!r}") from err


def url_problems(urls: Any) -> list[str]:
    """`engine.options.urls`: a non-empty list of distinct http(s)://host:port URLs (no path: the routes are the
    engine's own)."""
    allowed = "a non-empty list of server URLs such as [http://127.0.0.1:8101,http://127.0.0.1:8102]"
    if isinstance(urls, str) or not isinstance(urls, (list, tuple)) or not urls:
        return [f"engine.options.urls={urls!r} is not valid; allowed: {allowed}"]
    problems = []
    for url in urls:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            problems.append(f"engine.options.urls: {url!r} is not a server URL; allowed: http(s)://HOST:PORT, "
                            "without a path")
    if not problems and len({u.rstrip("/") for u in urls}) != len(urls):
        problems.append(f"engine.options.urls={list(urls)!r} names a server twice; allowed: {allowed}")
    return problems


class ServerPool:
    """The servers of a run and which of them still answer.

    Args:
        urls: the servers' base URLs.
        timeout_s: bound on one request, from its start to its answer's end (a generation, or one step of a weight
            update).
        connect_timeout_s: bound on opening a connection.
        max_inflight: requests in flight at once, over all servers (each server batches what it receives).
        max_response_bytes: bound on one answer (a larger one is refused unread).
    """

    def __init__(self, urls: Sequence[str], *, timeout_s: float, connect_timeout_s: float, max_inflight: int,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
        self.urls = [u.rstrip("/") for u in urls]
        self.connect_timeout_s = connect_timeout_s
        self.client = HTTPClient(timeout_s, max_response_bytes, size_key="engine.options.max_response_bytes",
                                 connect_timeout_s=connect_timeout_s)
        self.gone: dict[str, str] = {}  # url -> why it was given up
        self.retried = 0  # requests sent again to another server after theirs stopped answering
        self._lock = threading.Lock()
        self._rotation = 0  # which server takes the first group of a call: successive calls start elsewhere
        self._executor = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="lit_rlvr_server")

    def post(self, url: str, route: str, payload: Any = None, *, timeout: Optional[float] = None,
             params: Optional[dict] = None) -> Any:
        """POST `payload` as JSON (none when None) to `url + route`; the decoded JSON answer (None for an empty
        body). Raises `HTTPRefusal` (a server that does not answer: `gone`) or `RuntimeError` (not JSON)."""
        body = None if payload is None else json.dumps(payload).encode()
        return decoded(url + route, self.client.post(url + route, body, params=params, timeout_s=timeout))

    def get(self, url: str, route: str, *, timeout: Optional[float] = None) -> Any:
        """GET `url + route` (see `post`)."""
        return decoded(url + route, self.client.get(url + route, timeout_s=timeout))

    def alive(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if u not in self.gone]

    def give_up(self, url: str, err: BaseException) -> None:
        with self._lock:
            self.gone.setdefault(url, f"{type(err).__name__}: {str(err)[:160]}")

    def _require_alive(self, doing: str) -> list[str]:
        alive = self.alive()
        if not alive:
            reasons = "; ".join(f"{u} ({why})" for u, why in self.gone.items())
            raise EngineError(f"every rollout server is gone while {doing}: {reasons}")
        return alive

    def run(self, jobs: Sequence[tuple[int, Callable[[str], T]]], doing: str) -> list[T]:
        """`fn(url)` of each job `(key, fn)`, all in flight at once; the results in job order. Jobs with equal keys
        go to one server (a group's samples share its prefix cache), keys are spread over the servers that answer.
        A job whose server does not answer goes to another one; none left raises `EngineError`."""
        with self._lock:
            start, self._rotation = self._rotation, self._rotation + 1

        def attempt(key: int, fn: Callable[[str], T]) -> T:
            while True:
                alive = self._require_alive(doing)
                url = alive[(key + start) % len(alive)]
                try:
                    return fn(url)
                except HTTPRefusal as err:
                    if not gone(err):
                        raise
                    self.give_up(url, err)
                    with self._lock:
                        self.retried += 1

        futures = [self._executor.submit(attempt, key, fn) for key, fn in jobs]
        return [f.result() for f in futures]

    def each(self, fn: Callable[[str], T], doing: str) -> dict[str, T]:
        """`fn(url)` on every server that answers, at once; a server that stops answering is given up (the others
        go on); none left raises `EngineError`. Any other failure is raised."""
        urls = self._require_alive(doing)
        futures = {url: self._executor.submit(fn, url) for url in urls}
        results: dict[str, T] = {}
        for url, future in futures.items():
            try:
                results[url] = future.result()
            except HTTPRefusal as err:
                if not gone(err):
                    raise
                self.give_up(url, err)
        self._require_alive(doing)
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class ServerEngine(RolloutEngine):
    """A `RolloutEngine` whose generation and weights live in servers (see the module docstring). Subclasses say
    what a server of their kind is (`_identify`), how a batch of samples is asked for (`_sample`) and how the
    staged weights reach one server (`_update`).

    Args:
        urls: the servers' base URLs (`engine.options.urls`).
        weight_transfer: how weights reach the servers (the subclass's `_WEIGHT_TRANSFERS`).
        timeout_s: bound on one generation request's answer.
        push_timeout_s: bound on each call of a weight update (pause, load, resume).
        connect_timeout_s: bound on opening a connection (a server that is gone is found out in this time).
        max_inflight: requests in flight at once over all servers.
        max_response_bytes: bound on one answer of a server (a larger one is refused unread).
        weight_dir: where staged weight files are written (on a filesystem the servers read: the same machine, or
            a shared one); None = /dev/shm when it has room for twice the policy's weights, else the system's
            temporary folder.
        dtype: the servers' weight dtype, pushes are cast to it (None: the policy's).
        bucket_bytes: the trainer's bucket cap (the whole push is staged before any server takes it).
        lora_sync: merged, the only value (the servers' adapter routes are not wired: a LoRA policy's pushes are
            W + (α/r)·B A of every adapted layer, with the other weights).
    """

    _KIND = "server"
    _WEIGHT_TRANSFERS: tuple[str, ...] = ()
    bucket_bytes = 256 << 20
    # a LoRA policy reaches the servers as merged weights, all of them each push: the servers' loaders are not
    # tested on a part of a fused layer (vLLM's layerwise reload, SGLang's folder load)
    takes_weight_subsets = False

    def __init__(self, model: nn.Module, tokenizer, *, urls: Sequence[str], weight_transfer: str = "",
                 timeout_s: float = 600.0, push_timeout_s: float = 300.0, connect_timeout_s: float = 10.0,
                 max_inflight: int = 64, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 weight_dir: Optional[str] = None, dtype: Optional[str] = None, bucket_bytes: int = 256 << 20,
                 lora_sync: str = "merged"):
        problems = url_problems(list(urls) if not isinstance(urls, str) else urls)
        weight_transfer = weight_transfer or self._WEIGHT_TRANSFERS[0]
        if weight_transfer not in self._WEIGHT_TRANSFERS:
            problems.append(f"engine.options.weight_transfer={weight_transfer!r} is not valid; valid: "
                            f"{', '.join(self._WEIGHT_TRANSFERS)}")
        for key, value in (("timeout_s", timeout_s), ("push_timeout_s", push_timeout_s),
                           ("connect_timeout_s", connect_timeout_s)):
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                problems.append(f"engine.options.{key}={value!r} is not valid; allowed: a finite number of seconds > 0")
        for key, value in (("max_inflight", max_inflight), ("max_response_bytes", max_response_bytes)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                problems.append(f"engine.options.{key}={value!r} is not valid; allowed: an integer >= 1")
        if lora_sync != "merged":
            problems.append(f"engine.options.lora_sync={lora_sync!r} is not valid for a server engine; valid: merged "
                            "(a LoRA policy reaches the servers as merged weights)")
        weight_dtype = getattr(torch, dtype, None) if dtype else next(model.parameters()).dtype
        if not isinstance(weight_dtype, torch.dtype):
            problems.append(f"engine.options.dtype={dtype!r} is not valid; allowed: a torch dtype (float32, bfloat16)")
        ConfigError.check(problems)
        self._weight_transfer, self.weight_dtype, self.lora_sync = weight_transfer, weight_dtype, lora_sync
        self.bucket_bytes = int(bucket_bytes)
        self._push_timeout_s = float(push_timeout_s)
        self._eos_id = tokenizer.eos_token_id
        self._staged: list[str] = []  # the files of the push being written
        policy_bytes = sum(p.numel() for p in model.parameters()) * weight_dtype.itemsize
        # removed by `shutdown`, or when the engine is collected or the process exits (nothing calls shutdown then)
        self._weight_folder = tempfile.TemporaryDirectory(prefix="lit_rlvr_push_",
                                                          dir=weight_dir or shared_memory(policy_bytes))
        self._weight_root = self._weight_folder.name
        self._config_files = policy_config_files(model)  # a pushed folder holds them beside the weights (SGLang)
        self._pushes = 0
        self._retried_reported = 0
        self._pool = ServerPool(urls, timeout_s=float(timeout_s), connect_timeout_s=float(connect_timeout_s),
                               max_inflight=max_inflight, max_response_bytes=max_response_bytes)
        self._model_path = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        self._check_servers(model)

    # -- what the servers are ------------------------------------------------------------------------------------
    def _check_servers(self, model: nn.Module) -> None:
        """Each URL answers as a server of this kind, serving this run's model: one line per URL otherwise, before
        any work (a server that does not answer at all is refused too: the run starts with all its servers)."""
        problems = []
        for url in self._pool.urls:
            try:
                served = self._identify(url)
            except (RuntimeError, ValueError, KeyError, TypeError) as err:  # HTTPRefusal: a RuntimeError
                problems.append(f"engine.options.urls: {url} is not a {self._KIND} server that answers "
                                f"({type(err).__name__}: {str(err)[:200]}); start one with lit-rlvr-serve --engine "
                                f"{self._KIND.lower()} --model MODEL --port PORT")
                continue
            if not same_model(served, self._model_path):
                problems.append(f"engine.options.urls: {url} serves model {served!r} but this run trains "
                                f"{self._model_path or type(model).__name__!r}; start that server on the run's model")
        ConfigError.check(problems)
        for url in self._pool.urls:  # only once every server is the right one: nothing is asked of a wrong one
            try:
                self._prepare(url)
            except RuntimeError as err:
                problems.append(f"engine.options.urls: {url} cannot take weight updates ({str(err)[:200]}); start "
                                f"it with lit-rlvr-serve --engine {self._KIND.lower()}")
        ConfigError.check(problems)

    def _identify(self, url: str) -> str:
        """The model `url` serves (its path); raises when it is not a server of this kind."""
        raise NotImplementedError

    def _prepare(self, url: str) -> None:
        """Set up what a server needs before the first push (nothing by default)."""

    # -- sampling ------------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int],
                 params: SamplingParams) -> list[list[Completion]]:
        if params.adapter is not None:
            raise RuntimeError(f"{type(self).__name__} serves no adapters; asked for {params.adapter!r}")
        if len(prompt_token_ids) != len(n_per_prompt):
            raise ValueError(f"{len(prompt_token_ids)} prompts but {len(n_per_prompt)} sample counts")
        return self._sample(prompt_token_ids, n_per_prompt, params)

    def _sample(self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int],
                params: SamplingParams) -> list[list[Completion]]:
        raise NotImplementedError

    # -- weights -------------------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """One bucket, written to its file now (the tensors are not kept): in place over the previous push's file of
        this bucket where that holds the same tensors, else anew; on rank 0 only (the pusher: every server takes one
        push, whatever the number of trainer ranks)."""
        if rank() != 0:
            return
        if not self._staged:
            self._pushes += 1
        path = os.path.join(self._weight_root, f"model-{len(self._staged) + 1:05d}.safetensors")
        tensors = {name: t.detach().to("cpu", self.weight_dtype).contiguous() for name, t in named_tensors}
        if not rewrite_in_place(path, tensors):
            save_file(tensors, path)
        self._staged.append(path)

    def end_weight_update(self) -> None:
        """Every server takes the staged weights (`_update`, paused around it); the staged files are rewritten only
        by the next push, once every server that answers has acknowledged this one. Under several ranks, rank 0
        pushes and every rank returns (or raises) only once it has: its outcome is broadcast."""
        failure, err = None, None
        if rank() == 0:
            try:
                self._push_staged()
            except Exception as raised:  # every other rank raises it too, below
                failure, err = f"{type(raised).__name__}: {raised}", raised
        failure = broadcast_object(failure)
        if err is not None:
            raise err
        if failure is not None:
            raise EngineError(f"rank 0's weight push failed, so this rank stops too: {failure}")

    def _push_staged(self) -> None:
        if not self._staged:
            return
        folder = self._weight_root
        try:
            for name in os.listdir(folder):  # an earlier push's files this one did not rewrite (fewer buckets)
                if name.endswith(".safetensors") and os.path.join(folder, name) not in self._staged:
                    os.unlink(os.path.join(folder, name))
            staged = self._stage(folder, self._staged)
            self._pool.each(lambda url: self._update(url, staged), f"pushing weights (push {self._pushes})")
        finally:
            self._staged = []

    def _stage(self, folder: str, files: list[str]) -> Any:
        """What `_update` sends for this push, given its folder and the bucket files written in it."""
        return files

    def _update(self, url: str, staged: Any) -> None:
        raise NotImplementedError

    # -- metrics and lifetime ------------------------------------------------------------------------------------
    def take_metrics(self) -> dict[str, float]:
        """`engine/servers_alive` now and `engine/requests_retried` since the last take."""
        retried = self._pool.retried - self._retried_reported
        self._retried_reported = self._pool.retried
        return {"engine/servers_alive": float(len(self._pool.alive())), "engine/requests_retried": float(retried)}

    def generation_dtype(self) -> Optional[torch.dtype]:
        return self.weight_dtype

    def shutdown(self) -> None:
        """Stop talking to the servers (they were started outside the run and keep running)."""
        self._pool.close()
        self._weight_folder.cleanup()


# safetensors' names of the dtypes a policy's weights come in (a file of any other is written anew each push)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def rewrite_in_place(path: str, tensors: dict[str, Tensor]) -> bool:
    """Write `tensors`' bytes over an existing safetensors file at `path` that holds exactly these names, dtypes and
    shapes (the previous push's file of this bucket), at the offsets its header gives; False where there is no such
    file or a write fell short (the caller then writes the file anew)."""
    layout = {name: (SAFETENSORS_DTYPES.get(t.dtype), list(t.shape)) for name, t in tensors.items()}
    try:
        with open(path, "r+b") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
            header.pop("__metadata__", None)
            if {name: (entry["dtype"], entry["shape"]) for name, entry in header.items()} != layout:
                return False
            for name, tensor in tensors.items():
                data = tensor.reshape(-1).view(torch.uint8).numpy()  # the raw bytes, any dtype (bf16 has no numpy)
                if os.pwrite(handle.fileno(), memoryview(data), 8 + size + header[name]["data_offsets"][0]) \
                        != data.nbytes:
                    return False
    except (OSError, ValueError, KeyError, TypeError):  # no file, or not a safetensors file of this layout
        return False
    return True


def shared_memory(nbytes: int, folder: str = "/dev/shm") -> Optional[str]:
    """`folder` (shared memory: the servers on this machine read the files without a disk) when it has room for
    twice `nbytes` (a push being written beside one being read), else None: the system's temporary folder. A
    container's /dev/shm is often 64 MB."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) and stats.f_bavail * stats.f_frsize >= 2 * nbytes else None


def policy_config_files(model: nn.Module) -> dict[str, bytes]:
    """The policy's HF config files (`save_policy_config`), by file name."""
    with tempfile.TemporaryDirectory(prefix="lit_rlvr_config_") as folder:
        save_policy_config(model, folder)
        return {name: Path(folder, name).read_bytes() for name in os.listdir(folder)}


def same_model(served: str, trained: str) -> bool:
    """Whether a server's model path names the run's model: the same path, or a local folder with the same HF config
    (a copy, or a checkpoint of the same architecture: the run's first push replaces every weight before any
    rollout, and the post-push check compares values)."""
    if not trained:
        return True  # an in-memory model (a notebook): nothing to compare by name; the post-push check compares
    if os.path.realpath(os.path.expanduser(served)) == os.path.realpath(os.path.expanduser(trained)):
        return True
    configs = [os.path.join(os.path.expanduser(p), "config.json") for p in (served, trained)]
    return all(os.path.isfile(c) for c in configs) and _config(configs[0]) == _config(configs[1])


def _config(path: str) -> dict:
    with open(path) as handle:
        config = json.load(handle)
    return {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}


def wait_until(deadline_s: float, ready: Callable[[], bool], every_s: float = 0.5) -> bool:
    """Poll `ready()` until it is true or `deadline_s` seconds have passed; returns whether it became true."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if ready():
            return True
        time.sleep(every_s)
    return ready()
