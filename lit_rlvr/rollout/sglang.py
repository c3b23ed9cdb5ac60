"""`SGLangEngine`: one colocated `sglang.Engine` per rank (docs/architecture.md §7), token ids in and out.
Pinned: sglang==0.5.23.

The engine starts with dummy weights; `load_weights` streams the trainer's tensors in buckets inside one sglang
weight-update session, and `end_weight_update` closes it and flushes the prefix cache once. `sleep`/`wake`
release and restore the GPU memory (weights, KV cache, CUDA graphs) around training. Request building and result
parsing are pure functions, tested on CPU against outputs written from sglang 0.5.23's source.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import importlib
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from lit_rlvr.models.lora import is_lora
from lit_rlvr.rollout.engine import (
    Completion,
    EngineError,
    RolloutEngine,
    SamplingParams,
    expand_rows,
    save_policy_config,
    split_by_source,
)
from lit_rlvr.rollout.lora import check_lora_sync
from lit_rlvr.rollout.segments import SegmentedPushes

FINISH_REASONS = {"stop": "stop", "length": "length"}  # sglang finish_reason["type"] -> ours; "abort" raises
# Explicit so server-side `preferred_sampling_params` cannot add penalties that change the behaviour log-probs.
NEUTRAL_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
SEED_STRIDE = 1_000_003  # row seeds of one call: seed * stride + row (distinct while a call has < 1M rows)
IDLE_ROUND_TRIPS = 2  # scheduler loop passes before a release (one more for the overlap scheduler's result queue)
IDLE_TIMEOUT_S = 60.0  # bound on each pass: a scheduler that does not answer is dead or stuck


def build_requests(
    prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams,
    eos_id: Optional[int],
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """One sglang request per sample (prompt b repeated n_b times, in order) -> (input_ids, sampling_params).

    Each row has its own `sampling_seed`: sglang's seeded sampler hashes (seed, position), so rows sharing a
    prompt and a seed would draw the same tokens. Temperature 0 is sent as is (sglang turns it into top_k=1 at
    temperature 1, the same greedy convention as HFEngine); top_k 0 ("off") becomes sglang's -1.
    """
    input_ids, stop = expand_rows(prompt_token_ids, n_per_prompt, params, eos_id, "sglang")
    sampling = [{
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "stop_token_ids": stop,
        "ignore_eos": params.ignore_eos,
        "sampling_seed": (params.seed * SEED_STRIDE + row) % (1 << 63),
        **NEUTRAL_SAMPLING,
    } for row in range(len(input_ids))]
    return input_ids, sampling


def parse_outputs(outputs: Sequence[dict], n_per_prompt: Sequence[int]) -> list[list[Completion]]:
    """sglang's batch output (one dict per request, in request order) -> completions per prompt.

    Each dict is `{"output_ids": [t], "meta_info": {"finish_reason": {"type": ...}, "output_token_logprobs":
    [(logprob, token_id, None), ...], ...}}`; the ids include the matched stop token and the log-probs align.
    """
    if len(outputs) != sum(n_per_prompt):
        raise RuntimeError(f"sglang returned {len(outputs)} outputs for {sum(n_per_prompt)} requests")
    rows = iter(outputs)
    return [[_completion(next(rows)) for _ in range(n)] for n in n_per_prompt]


def _completion(out: dict) -> Completion:
    meta = out["meta_info"]
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in FINISH_REASONS:
        raise RuntimeError(f"sglang request {meta.get('id')} ended with {meta.get('finish_reason')!r}")
    ids = [int(t) for t in out["output_ids"]]
    logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
    if [int(entry[1]) for entry in meta["output_token_logprobs"]] != ids:
        raise RuntimeError(f"sglang request {meta.get('id')}: output_token_logprobs do not match output_ids")
    return Completion(torch.tensor(ids, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32),
                      FINISH_REASONS[reason])


def rank_info() -> tuple[int, int]:
    """(global rank, local rank) of this process; (0, 0) outside torch.distributed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0, 0
    rank = torch.distributed.get_rank()
    return rank, int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))


def engine_args(model_path: str, dtype: torch.dtype, *, rank: int, local_rank: int, base_port: int, port_stride: int,
                seed: int, mem_fraction_static: float, deterministic: bool, server_args: dict) -> dict[str, Any]:
    """`sglang.Engine` keyword arguments (ServerArgs fields) for this rank: own GPU, ports and seed."""
    port = base_port + port_stride * local_rank  # colocated engines share a node: space them by local rank
    return {
        "model_path": model_path,
        "skip_tokenizer_init": True,  # token ids in and out
        "load_format": "dummy",  # the first push brings the weights
        "enable_memory_saver": True,  # release_/resume_memory_occupation around training
        "dtype": str(dtype).removeprefix("torch."),
        # on a CPU sglang reads it as a NUMA node index (a 1-node machine has only 0)
        "base_gpu_id": 0 if server_args.get("device") == "cpu" else local_rank,
        "port": port,
        "nccl_port": port + 1,  # else sglang picks a free port, which races between ranks starting together
        "random_seed": seed + rank,
        "mem_fraction_static": mem_fraction_static,
        "enable_deterministic_inference": deterministic,  # honours per-request sampling_seed (slower kernels)
        **server_args,
    }


@contextlib.contextmanager
def only_own_children(engine_module, pids: Sequence[int]):
    """Narrow `Engine.shutdown`'s `kill_process_tree(os.getpid(), include_parent=False)` (every child of this
    process: DataLoader workers, reward sandboxes, other engines) to the trees of this engine's own `pids`."""
    original = engine_module.kill_process_tree

    def scoped(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid in (None, os.getpid()) and not include_parent:
            for pid in pids:
                original(pid, include_parent=True, wait_timeout=wait_timeout)
            return
        original(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)

    engine_module.kill_process_tree = scoped
    try:
        yield
    finally:
        engine_module.kill_process_tree = original


def launch_failed(signum, frame):
    """sglang's `custom_sigquit_handler` while the engine starts: a child that fails sends this process SIGQUIT,
    and sglang's default answer kills this process (the trainer). Raise in the waiting main thread instead."""
    raise EngineError("an sglang process died while the engine was starting (its traceback is in the log above)")


def _zmq_contexts() -> dict[int, Any]:
    """This process's pyzmq contexts by id (none before sglang imports pyzmq)."""
    zmq = sys.modules.get("zmq")
    return {} if zmq is None else {id(obj): obj for obj in gc.get_objects() if isinstance(obj, zmq.Context)}


def _clean_up_failed_start(engine_module, children_before: set[int], contexts_before: set[int]) -> None:
    """Kill and reap the processes a failed `sglang.Engine(...)` left, and close its zmq contexts without
    lingering: garbage-collected, an open context waits forever for its dead peers (the trainer hangs at exit)."""
    import psutil

    children = [p for p in psutil.Process().children() if p.pid not in children_before]
    for child in children:
        engine_module.kill_process_tree(child.pid, include_parent=True, wait_timeout=10)
    psutil.wait_procs(children, timeout=10)  # reap: killed children stay zombies until their parent waits
    for key, context in _zmq_contexts().items():
        if key not in contexts_before and not context.closed:
            context.destroy(linger=0)


def _import_engine_module():
    try:
        return importlib.import_module("sglang.srt.entrypoints.engine")
    except ImportError as err:
        raise ImportError('engine=sglang needs SGLang 0.5.23 (GPU): pip install -e ".[sglang]"') from err


def _check(result, what: str) -> None:
    """sglang's weight-update calls return (success, message), flush_cache a FlushCacheReqOutput, the LoRA calls a
    LoRAUpdateOutput; none raises."""
    if isinstance(result, tuple):
        success, message = result
    else:
        success, message = result.success, getattr(result, "message", None) or getattr(result, "error_message", "")
    if not success:
        raise RuntimeError(f"sglang {what} failed: {message}")


def lora_server_args(model: nn.Module, max_loras: int, cpu: bool = False) -> dict[str, Any]:
    """`sglang.Engine` arguments that serve the policy's LoRA adapters: its rank, the module names they adapt
    (the last part of peft's paths), and how many adapters one batch may mix (C3PO's N samples and the mean); on a
    CPU the pure-torch LoRA kernels (sglang's default ones are Triton's)."""
    config = model.peft_config["default"]
    targets = config.target_modules
    names = sorted({t.rsplit(".", 1)[-1] for t in ([targets] if isinstance(targets, str) else targets)})
    return {"enable_lora": True, "max_lora_rank": int(config.r), "lora_target_modules": names,
            "max_loras_per_batch": int(max_loras), **({"lora_backend": "torch_native"} if cpu else {})}


class SGLangEngine(SegmentedPushes, RolloutEngine):
    """The RolloutEngine protocol on `sglang.Engine`; `holds_weights` is False until the first push and after a
    sleep. Pushes land while it generates between segments of `segment_tokens` new tokens
    (`lit_rlvr.rollout.segments`)."""

    def __init__(self, model: nn.Module, tokenizer, *, mem_fraction_static: float = 0.5, bucket_bytes: int = 256 << 20,
                 base_port: int = 30000, port_stride: int = 10, seed: int = 0, deterministic: bool = False,
                 dtype: Optional[str] = None, model_path: Optional[str] = None, server_args: Optional[dict] = None,
                 lora_sync: str = "adapter", max_loras: int = 8, segment_tokens: int = 32):
        self.lora_sync = check_lora_sync(lora_sync)
        self._init_segments(segment_tokens, tokenizer.eos_token_id)
        self._adapters: set[str] = set()  # names of the adapters it holds
        self._active_adapter: Optional[str] = None  # the one a request without `SamplingParams.adapter` uses
        server_args = dict(server_args or {})
        if is_lora(model) and lora_sync == "adapter":  # sglang's multi-LoRA serving: an adapter per request
            self.serves_lora = self.serves_many_adapters = self.can_generate_stacked = True
            server_args = {**lora_server_args(model, max_loras, cpu=server_args.get("device") == "cpu"),
                           **server_args}
        module = _import_engine_module()
        # sglang's sampler returns log softmax(logits / T) unless this is set (then: before temperature scaling)
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "false").lower() in ("1", "true"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: sglang would return log-probs before temperature "
                             "scaling, but the engine must return them under softmax(logits / T); unset it")
        self._eos_id = tokenizer.eos_token_id
        self.bucket_bytes = bucket_bytes
        self._asleep = self._updating = self._has_weights = False
        self._config_dir = None
        if model_path is None:  # load_format=dummy reads only the config: write the policy's own
            self._config_dir = tempfile.TemporaryDirectory(prefix="lit_rlvr_sglang_")
            save_policy_config(model, self._config_dir.name)
            model_path = self._config_dir.name
        rank, local_rank = rank_info()
        weight_dtype = getattr(torch, dtype, None) if dtype else next(model.parameters()).dtype
        if not isinstance(weight_dtype, torch.dtype):
            raise ValueError(f"engine.options.dtype={dtype!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
        self.weight_dtype = weight_dtype  # pushes are cast to it before bucketing (bf16 halves the bytes sent)
        kwargs = engine_args(model_path, weight_dtype, rank=rank, local_rank=local_rank, base_port=base_port,
                             port_stride=port_stride, seed=seed, mem_fraction_static=mem_fraction_static,
                             deterministic=deterministic, server_args=server_args)
        self._module, self._engine, self._death = module, None, None
        self._engine = self._start(module, kwargs)
        atexit.unregister(self._engine.shutdown)  # its blanket kill would end every child of this process
        atexit.register(self.shutdown)
        self._watch_children()

    def _start(self, module, kwargs: dict):
        """`sglang.Engine(**kwargs)`; a child that dies while starting is an `EngineError`, its processes killed."""
        import psutil

        main = threading.current_thread() is threading.main_thread()
        if main:
            kwargs.setdefault("custom_sigquit_handler", launch_failed)
        children, contexts = {p.pid for p in psutil.Process().children()}, set(_zmq_contexts())
        start_method = multiprocessing.get_start_method(allow_none=True)
        handler = signal.getsignal(signal.SIGQUIT) if main else None
        try:
            return module.Engine(**kwargs)
        except BaseException as err:
            _clean_up_failed_start(module, children, contexts)
            if isinstance(err, EngineError):
                raise
            if isinstance(err, Exception):
                raise EngineError(f"sglang.Engine did not start: {err!r}") from err
            raise
        finally:
            multiprocessing.set_start_method(start_method, force=True)  # sglang forces "spawn" process-wide
            if main:
                signal.signal(signal.SIGQUIT, handler)

    def _watch_children(self) -> None:
        """sglang's tokenizer manager answers a child's death (SIGQUIT from the child or from its watchdog thread)
        by killing this whole process tree, the trainer included. Replace that answer: record the cause and stop
        the event loop, so the waiting call returns and raises `EngineError`."""
        manager = getattr(self._engine, "tokenizer_manager", None)
        if manager is None or threading.current_thread() is not threading.main_thread():
            return
        loop = self._engine.loop

        async def create_handle_loop():  # on the engine's loop: outside one, sglang would make a new loop
            manager.auto_create_handle_loop()  # installs sglang's handler now (else lazily, over ours)

        loop.run_until_complete(create_handle_loop())

        def died() -> None:
            self._death = self._death or self._dead_children()
            loop.stop()

        loop.add_signal_handler(signal.SIGQUIT, died)

    def _dead_children(self) -> str:
        watchdog = self._watchdog()
        for proc, name in zip(getattr(watchdog, "_processes", []), getattr(watchdog, "_names", [])):
            if not proc.is_alive():
                return f"sglang's {name} (pid {proc.pid}) exited with code {proc.exitcode}"
        return "an sglang process signalled a failure (SIGQUIT)"

    def _call(self, what: str, fn, *args, **kwargs):
        """One call into the engine; a dead child process turns into an `EngineError` naming it."""
        if self._death is None:
            try:
                return fn(*args, **kwargs)
            except Exception as err:
                if self._death is None and not self._any_dead():
                    raise
                self._death = self._death or self._dead_children()
                raise EngineError(f"SGLangEngine could not {what}: {self._death}; see its traceback in the log "
                                  "above") from err
        raise EngineError(f"SGLangEngine cannot {what}: {self._death}; see its traceback in the log above")

    def _watchdog(self, engine=None):
        manager = getattr(engine or self._engine, "tokenizer_manager", None)
        return getattr(manager, "_subprocess_watchdog", None)

    def _any_dead(self) -> bool:
        return any(not proc.is_alive() for proc in getattr(self._watchdog(), "_processes", []))

    def _wait_idle(self) -> None:
        """Wait, bounded, until the scheduler has let go of the last batch. sglang asserts that the server is
        idle on `release_memory_occupation`, and a failed assert ends the scheduler (and, by SIGQUIT, the
        caller): right after `generate` returns, the scheduler still holds the finished batch as `last_batch`
        until its loop passes once more. Each round trip of a request through that loop is one pass."""
        manager = getattr(self._engine, "tokenizer_manager", None)
        for _ in range(IDLE_ROUND_TRIPS if manager is not None else 0):
            self._call("wait for an idle scheduler", self._engine.loop.run_until_complete,
                       asyncio.wait_for(manager.get_internal_state(), IDLE_TIMEOUT_S))

    # -- weights ---------------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """One bucket (HF names); the first bucket opens sglang's weight-update session, no cache flush yet."""
        if self._staged_call("load_weights", named_tensors):
            return
        self.wake()
        if not self._updating:
            _check(self._call("begin a weight update", self._engine.begin_weight_update), "begin_weight_update")
            self._updating = True
        _check(self._call("load weights", self._engine.update_weights_from_tensor, list(named_tensors),
                          flush_cache=False), "update_weights_from_tensor")

    def end_weight_update(self) -> None:
        """After the last bucket: close the session (sglang finalizes the weights) and flush the KV cache once."""
        if self._staged_call("end_weight_update"):
            return
        if not self._updating:
            return
        _check(self._call("end a weight update", self._engine.end_weight_update), "end_weight_update")
        self._updating = False
        _check(self._call("flush the cache", self._engine.flush_cache), "flush_cache")
        self._has_weights = True

    @property
    def holds_weights(self) -> bool:
        return self._has_weights

    # -- memory ----------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release weights, KV cache and CUDA graphs; the weights are not backed up, so the next push must
        bring them (`holds_weights` False makes the trainer push again)."""
        if self._asleep or self._engine is None:
            return
        self.end_weight_update()
        for name in sorted(self._adapters):  # the next push brings base and adapter again, under a new name
            self._unload_adapter(name)
        self._active_adapter = None
        self._wait_idle()
        self._call("release memory", self._engine.release_memory_occupation)
        self._asleep, self._has_weights = True, False

    def wake(self) -> None:
        if not self._asleep or self._engine is None:
            return
        self._call("resume memory", self._engine.resume_memory_occupation)
        self._asleep = False

    # -- sampling --------------------------------------------------------------------------------------------
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams
    ) -> list[list[Completion]]:
        return self._generate_with_pushes(self._generate_once, prompt_token_ids, n_per_prompt, params)

    def _generate_once(
        self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams
    ) -> list[list[Completion]]:
        self.wake()
        self.end_weight_update()  # a caller that pushed without closing the update
        if not self._has_weights:
            raise RuntimeError("SGLangEngine holds no weights (dummy at start, released by sleep): push weights "
                               "with lit_rlvr.rollout.weights.push_weights before generate")
        input_ids, sampling = build_requests(prompt_token_ids, n_per_prompt, params, self._eos_id)
        if not input_ids:  # sglang rejects an empty batch
            return [[] for _ in prompt_token_ids]
        adapter = self._adapter(params.adapter)
        lora = {} if adapter is None else {"lora_path": [adapter] * len(input_ids)}
        outputs = self._call("generate", self._engine.generate, input_ids=input_ids, sampling_params=sampling,
                             return_logprob=True, **lora)
        return parse_outputs(outputs, n_per_prompt)

    def generate_stacked(self, prompt_token_ids: Sequence[Sequence[int]], counts_per_source: list[list[int]],
                         params_per_source: list[SamplingParams], stacks=None) -> list[list[list[Completion]]]:
        """Every weight source's rows in one `Engine.generate` call, each request with its source's adapter
        (`params.adapter`, loaded by `load_adapter`) and seeds: C3PO's N sampled adapters over one base."""
        self.wake()
        self.end_weight_update()
        input_ids, sampling, adapters = [], [], []
        for counts, params in zip(counts_per_source, params_per_source):
            rows, kwargs = build_requests(prompt_token_ids, counts, params, self._eos_id)
            input_ids += rows
            sampling += kwargs
            adapters += [self._adapter(params.adapter)] * len(rows)
        outputs = (self._call("generate", self._engine.generate, input_ids=input_ids, sampling_params=sampling,
                              return_logprob=True, lora_path=adapters if self.serves_lora else None)
                   if input_ids else [])
        return split_by_source(outputs, counts_per_source, parse_outputs)

    # -- LoRA adapters ----------------------------------------------------------------------------------------
    def load_adapter(self, name: str, tensors: dict[str, Tensor], config: dict, activate: bool = True) -> None:
        """Hand the adapter's tensors (PEFT file keys) to sglang under `name`; adapters of earlier weight versions
        are unloaded first (their slots free)."""
        if not self.serves_lora:
            raise RuntimeError("SGLangEngine serves adapters only with a LoRA policy and lora_sync=adapter")
        if self._staged_call("load_adapter", name, tensors, config, activate):
            return
        self.wake()
        self.end_weight_update()
        version = name.rsplit("_", 1)[0]
        for old in [n for n in self._adapters if n.rsplit("_", 1)[0] != version and n != self._active_adapter]:
            self._unload_adapter(old)
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        _check(self._call("load a LoRA adapter", self._engine.load_lora_adapter_from_tensors, name, cpu, config),
               f"load_lora_adapter_from_tensors({name!r})")
        self._adapters.add(name)
        if activate:
            self._active_adapter = name

    def _unload_adapter(self, name: str) -> None:
        _check(self._call("unload a LoRA adapter", self._engine.unload_lora_adapter, name),
               f"unload_lora_adapter({name!r})")
        self._adapters.discard(name)

    def _adapter(self, name: Optional[str]) -> Optional[str]:
        """The adapter a request runs with: `name`, else the active one (None: the base alone)."""
        if not self.serves_lora:
            if name is not None:
                raise RuntimeError(f"SGLangEngine serves no adapters; asked for {name!r}")
            return None
        name = name or self._active_adapter
        if name is not None and name not in self._adapters:
            raise RuntimeError(f"SGLangEngine holds no adapter {name!r} (it holds {sorted(self._adapters)})")
        return name

    def shutdown(self) -> None:
        """End this engine's scheduler and detokenizer processes (and their children) only."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        atexit.unregister(self.shutdown)
        watched = list(getattr(self._watchdog(engine), "_processes", []))  # schedulers and the detokenizer
        own = sorted({*engine.get_all_child_pids(), *(p.pid for p in watched)})  # the former: schedulers only
        with only_own_children(self._module, own):
            if self._death:  # its children are gone or dying: kill what is left, no graceful drain
                self._module.kill_process_tree(os.getpid(), include_parent=False, wait_timeout=10)
            else:
                engine.shutdown()
        for proc in watched:
            proc.join(timeout=10)
        if self._config_dir is not None:
            self._config_dir.cleanup()
