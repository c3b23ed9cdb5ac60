"""The rollout engine contract: token ids in, token ids + behaviour log-probs out (docs/architecture.md §7)."""

from __future__ import annotations

import copy
import threading
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lit_rlvr.config.options import range_problems
from lit_rlvr.config.settings import AlgorithmConfig, SamplingOptions

DEFAULT = SamplingOptions()  # the sampling settings' defaults: one per setting (lit_rlvr.config.settings)


class EngineError(RuntimeError):
    """The rollout engine failed (its process died, or it did not answer in time); the message names the cause.
    `GRPOModule` re-raises it naming the step and the checkpoint to resume from."""


@contextmanager
def engine_hint(name: str, hint: Callable[[], str]) -> Iterator[None]:
    """An engine failure names the engine `name` and says what survives and what to do (`hint()`, asked then)."""
    try:
        yield
    except EngineError as err:  # the same class (e.g. EngineSyncError), with the engine's name and the hint
        raise type(err)(f"engine {name!r}: {err}; {hint()}") from err


@dataclass(frozen=True)
class SamplingParams:
    """The sampling options of one engine call. Temperature 0 is greedy, and its behaviour log-probs are those of
    softmax(logits) (temperature 1) in every engine; training samples at a temperature > 0 (`SamplingConfig`)."""

    temperature: float = DEFAULT.temperature  # 0 = greedy
    top_p: float = DEFAULT.top_p
    top_k: int = DEFAULT.top_k  # 0 = off
    max_new_tokens: int = DEFAULT.max_new_tokens
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's eos
    seed: int = 0
    # benchmarks: nothing stops a completion before max_new_tokens (eos, stop_token_ids)
    ignore_eos: bool = DEFAULT.ignore_eos
    adapter: Optional[str] = None  # LoRA: the loaded adapter to sample with (None: the one pushed last)
    # token sequences that end a completion once sampled (an environment's stop strings, tokenized): HFEngine stops
    # on them; other engines run on, and the multi-turn loop cuts the turn at the stop string either way
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        problems = range_problems({"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                   "max_new_tokens": self.max_new_tokens}, "sampling")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class SamplingConfig:
    """A run's sampling options, for training rollouts and for evaluation: `params(seed)` gives one call's. The
    defaults are `SamplingOptions`' (the `algorithm` group's), which `of(algorithm)` reads.

    `temperature` (training) must be > 0: at 0 every completion of a prompt is the same greedy one, so no
    advantage is ever nonzero; evaluation may be greedy (`eval_temperature` 0). `ignore_eos` applies to training
    only (benchmarks that need fixed lengths); evaluation always stops at eos."""

    temperature: float = DEFAULT.temperature
    top_p: float = DEFAULT.top_p
    top_k: int = DEFAULT.top_k
    max_new_tokens: int = DEFAULT.max_new_tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = DEFAULT.ignore_eos
    eval_temperature: float = DEFAULT.eval_temperature

    def __post_init__(self) -> None:
        problems = range_problems({"temperature": self.temperature, "eval_temperature": self.eval_temperature,
                                   "top_p": self.top_p, "top_k": self.top_k, "max_new_tokens": self.max_new_tokens},
                                  "algorithm")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def of(cls, algorithm: AlgorithmConfig, stop_token_ids: tuple[int, ...]) -> "SamplingConfig":
        """The sampling settings of `algorithm`, stopping at `stop_token_ids` (besides the tokenizer's eos)."""
        return cls(temperature=algorithm.temperature, top_p=algorithm.top_p, top_k=algorithm.top_k,
                   max_new_tokens=algorithm.max_new_tokens, ignore_eos=algorithm.ignore_eos,
                   eval_temperature=algorithm.eval_temperature, stop_token_ids=stop_token_ids)

    def params(self, seed: int, *, evaluation: bool = False) -> SamplingParams:
        return SamplingParams(temperature=self.eval_temperature if evaluation else self.temperature,
                              top_p=self.top_p, top_k=self.top_k, max_new_tokens=self.max_new_tokens, seed=seed,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos and not evaluation)


@dataclass
class Completion:
    token_ids: Tensor  # [t] long, including the stop token when one was produced
    logprobs: Tensor  # [t] float: log-prob of each token under softmax(logits / temperature)
    finish_reason: str  # "stop" | "length"
    token_mask: Optional[Tensor] = None  # [t] bool, True = sampled (False: an environment's observation); None = all
    # [t] long: the tag of the weights whose logits drew each token (`RolloutEngine.push_in_flight`); None = untagged
    versions: Optional[Tensor] = None


class RolloutEngine:
    """The whole engine contract (docs/architecture.md §7, checked against the engine classes by
    tests/test_engine_contract.py): the trainer calls nothing and reads nothing else of an engine.

    Subclasses implement `generate` and `load_weights`; every other member has a default that fits an engine
    with its own copy of the weights, in the trainer's process, with nothing to release. The attributes are what
    the engine is (capabilities, set when it is built) and `holds_weights`, what it serves with now; which weights
    those are (version, mean or weight sample, adapter names) is the trainer's bookkeeping, kept by
    `lit_rlvr.rollout.weight_sync.WeightSync`, never by the engine."""

    shares_weights: bool = False  # True: samples with the trainer's own model, so a push copies nothing
    can_generate_stacked: bool = False  # True: `generate_stacked` samples several weight sources in one call
    bucket_bytes: int = 256 << 20  # size cap of one `load_weights` call of a push
    weight_dtype: Optional[torch.dtype] = None  # pushes are cast to it (None: the trainer's dtype)
    model: Optional[nn.Module] = None  # its in-process model, if it has one
    holds_weights: bool = True  # False while it holds no pushed weights (a dummy start; a sleep that freed them)
    # LoRA (lit_rlvr.rollout.lora): how a LoRA policy reaches it (`engine.options.lora_sync`: adapter | merged)
    lora_sync: str = "adapter"
    serves_lora: bool = False  # True: `load_adapter` takes adapter tensors; generation uses `SamplingParams.adapter`
    serves_many_adapters: bool = False  # True: one `generate_stacked` call mixes adapters, one per weight source
    adapter_base_by_name: bool = True  # with adapters: the base weights arrive once by HF name (a server's dummy start)
    takes_weight_subsets: bool = True  # False: every push carries every weight (a LoRA policy's merged push too)
    max_lora_rank: Optional[int] = None  # the largest adapter rank it serves (None: any); checked with the config
    swaps_in_flight: bool = False  # True: `push_in_flight` lands a push between two decode steps of a generation

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams
    ) -> list[list[Completion]]:
        """`n_per_prompt[b]` completions of prompt b; returns them per prompt."""
        raise NotImplementedError

    def generate_stacked(self, prompt_token_ids: Sequence[Sequence[int]], per_source: Sequence[Sequence[int]],
                         params: Sequence[SamplingParams],
                         stacks: dict[Tensor, Tensor]) -> list[list[list[Completion]]]:
        """Completions per weight source s (counts `per_source[s]`, weights `stacks[·][s]`); when
        `can_generate_stacked`."""
        raise NotImplementedError(f"{type(self).__name__} has no stacked generation")

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Take new weights by HF parameter name; may be called once per bucket."""
        raise NotImplementedError

    def load_adapter(self, name: str, tensors: dict[str, Tensor], config: dict, activate: bool = True) -> None:
        """Take a LoRA adapter (PEFT file keys -> tensors, PEFT config) under `name`; with `activate` it becomes the
        one generation uses when `SamplingParams.adapter` is None (3PO's samples for a multi-adapter call are loaded
        aside); when `serves_lora`."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    def push_in_flight(self, tag: int, *, recompute_kv: bool = False) -> AbstractContextManager:
        """The `load_weights` / `load_adapter` calls made inside it form one push tagged `tag` (an opaque label, the
        trainer's version), which lands at once when the engine is not generating, else between two decode steps
        of the generation under way (unfinished completions continue under it; `recompute_kv`: their KV cache is
        computed again with the new weights, else kept). From then on each completion's `versions` give, per
        token, the tag of the weights that drew it (when `swaps_in_flight`)."""
        raise NotImplementedError(f"{type(self).__name__} takes no push while it generates")

    def end_weight_update(self) -> None:
        """Called after the last bucket of a push (SGLang flushes its cache once here)."""

    def to(self, device: torch.device) -> "RolloutEngine":
        """Follow the trainer's model to `device` (an in-process copy moves; a server stays)."""
        return self

    def generation_dtype(self) -> Optional[torch.dtype]:
        """The dtype it generates in: its model's; None when it cannot tell."""
        if isinstance(self.model, nn.Module):
            return next(self.model.parameters()).dtype
        return None

    def sleep(self) -> None:
        """Release what the trainer needs while it trains (KV cache, weights)."""

    def wake(self) -> None:
        """Take back what `sleep` released."""

    def shutdown(self) -> None:
        """End the engine's own processes, if any."""

    def take_metrics(self) -> dict[str, float]:
        """What the engine counted since the last call, as step metrics (server engines: `engine/servers_alive`,
        `engine/requests_retried`); none by default."""
        return {}


class InFlightPushes:
    """The threads' side of `push_in_flight` for an engine that takes pushes while it generates (HFEngine between
    two decode steps, `lit_rlvr.rollout.segments.SegmentedPushes` between two segments): a push made while no
    generation runs lands at once, and generations wait for it; one made while a generation runs is staged (the
    pushing thread's loads are copied aside: `_stages_here`) and lands when the generating thread calls
    `_land_staged`. The engine says how a push is staged (`_new_staging`), how staged pushes add up
    (`_add_staged`) and how they land (`_land_staged`); it generates inside `_generation()`."""

    def _init_in_flight(self) -> None:
        self._swap = threading.Condition()
        self._generating = False
        self._direct: Optional[int] = None  # the thread whose push lands at once: other generations wait for it
        self._staging = None  # the push under way while a generation runs
        self._pusher: Optional[int] = None  # the thread that pushes (the trainer's)
        self._tag: Optional[int] = None  # the tag of the weights held (None: no tagged push yet)

    def _new_staging(self, tag: int, recompute_kv: bool, thread: int):
        raise NotImplementedError

    def _add_staged(self, staging) -> None:
        raise NotImplementedError

    def _land_staged(self):
        raise NotImplementedError

    @contextmanager
    def push_in_flight(self, tag: int, *, recompute_kv: bool = False) -> Iterator[None]:
        me = threading.get_ident()
        with self._swap:
            self._pusher = me
            direct = not self._generating
            if direct:  # generations (of other threads) wait for it; one staged earlier lands first, under it
                self._direct = me
            else:
                self._staging = self._new_staging(tag, recompute_kv, me)
        try:
            if direct:
                self._land_staged()
            yield
        except BaseException:
            with self._swap:  # a failed push lands nothing (a direct one may have loaded part of it)
                self._staging, self._direct = None, None
                self._swap.notify_all()
            raise
        with self._swap:
            if direct:
                self._direct, self._tag = None, tag
            else:
                self._add_staged(self._staging)
                self._staging = None
            self._swap.notify_all()

    def _stages_here(self) -> bool:
        """Whether this thread's push is staged: its loads are copied aside for the generating thread."""
        staging = self._staging
        return staging is not None and staging.thread == threading.get_ident()

    @contextmanager
    def _generation(self) -> Iterator[None]:
        """A generation: it waits for another thread's push landing at once (the pushing thread's own post-push
        check generates inside it), lands the staged ones, and makes later pushes stage."""
        me = threading.get_ident()
        with self._swap:
            while self._direct is not None and self._direct != me:
                self._swap.wait()
            self._generating = True
        try:
            self._land_staged()
            yield
        finally:
            with self._swap:
                self._generating = False
                self._swap.notify_all()


def save_policy_config(model, path: str) -> None:
    """Write the policy's HF config to `path` for an engine started without weights: `architectures` set, since
    sglang and vLLM pick their model class from it (FSDP's `fully_shard` renames the module's class)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft wrapper: its model
    config = copy.deepcopy(model.config)
    if not getattr(config, "architectures", None) or any(a.startswith("Peft") for a in config.architectures):
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(path)


def expand_rows(prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams,
                eos_id, engine: str) -> tuple[list[list[int]], list[int]]:
    """One row per completion for a request-per-sample engine: prompt b repeated n_b times, in order, as plain
    ints, and the stop ids (the params' and the tokenizer's eos; none with `ignore_eos`, as SGLang does). Fails on
    a count mismatch or an empty prompt."""
    if len(prompt_token_ids) != len(n_per_prompt):
        raise ValueError(f"{len(prompt_token_ids)} prompts but {len(n_per_prompt)} sample counts")
    rows = []
    for b, (prompt, n) in enumerate(zip(prompt_token_ids, n_per_prompt)):
        if n > 0 and len(prompt) == 0:
            raise ValueError(f"prompt {b} is empty; {engine} needs at least one prompt token")
        rows += [[int(t) for t in prompt] for _ in range(n)]
    stop = [] if params.ignore_eos else sorted({*params.stop_token_ids, *([] if eos_id is None else [eos_id])})
    return rows, stop


def split_by_source(outputs: Sequence, counts_per_source: Sequence[Sequence[int]], parse) -> list:
    """A request-per-sample engine's one call over every weight source's rows, back into per-source completions:
    `parse(outputs_of_one_source, its_counts)` for each source's slice, in order."""
    out, start = [], 0
    for counts in counts_per_source:
        out.append(parse(outputs[start:start + sum(counts)], counts))
        start += sum(counts)
    return out
