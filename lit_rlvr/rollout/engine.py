"""The rollout engine protocol: token ids in, token ids + behaviour log-probs out (DESIGN §7)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence, runtime_checkable

from torch import Tensor


class EngineError(RuntimeError):
    """The rollout engine failed (its process died, or it did not answer in time); the message names the cause.
    `GRPOModule` re-raises it naming the step and the checkpoint to resume from."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 24
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's eos
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    token_ids: Tensor  # [t] long, including the stop token when one was produced
    logprobs: Tensor  # [t] float: log-prob of each token under softmax(logits / temperature)
    finish_reason: str  # "stop" | "length"
    extras: dict = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    version: int  # optimizer step whose weights the engine holds

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams
    ) -> list[list[Completion]]:
        """`n_per_prompt[b]` completions of prompt b; returns them per prompt."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Take new weights by HF parameter name; may be called once per bucket."""
        ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def shutdown(self) -> None: ...


def save_policy_config(model, path: str) -> None:
    """Write the policy's HF config to `path` for an engine started without weights: `architectures` set, since
    sglang and vLLM pick their model class from it (FSDP's `fully_shard` renames the module's class)."""
    config = copy.deepcopy(model.config)
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(path)


def expand_rows(prompt_token_ids: Sequence[Sequence[int]], n_per_prompt: Sequence[int], params: SamplingParams,
                eos_id, engine: str) -> tuple[list[list[int]], list[int]]:
    """One row per completion for a request-per-sample engine: prompt b repeated n_b times, in order, as plain
    ints, and the stop ids (the params' and the tokenizer's eos). Fails on a count mismatch or an empty prompt."""
    if len(prompt_token_ids) != len(n_per_prompt):
        raise ValueError(f"{len(prompt_token_ids)} prompts but {len(n_per_prompt)} sample counts")
    rows = []
    for b, (prompt, n) in enumerate(zip(prompt_token_ids, n_per_prompt)):
        if n > 0 and len(prompt) == 0:
            raise ValueError(f"prompt {b} is empty; {engine} needs at least one prompt token")
        rows += [[int(t) for t in prompt] for _ in range(n)]
    stop = sorted({*params.stop_token_ids, *([] if eos_id is None else [eos_id])})
    return rows, stop
