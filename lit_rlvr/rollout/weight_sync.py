"""`WeightSync`: the one owner of what a rollout engine holds of the policy, and of every push to it.

The rollout driver owns one. It knows which weights the engine samples with (their version: the policy's updates
when they were pushed, `lit_rlvr.rollout.source.RolloutSource.version`; the mean or a 3PO weight sample; whether the
base weights a LoRA push builds on are there; the adapters' names), decides whether a rollout needs a push, and
makes every push (full weights, LoRA adapters or merged weights: lit_rlvr.rollout.lora) through the engine's contract
methods. An engine keeps only what it needs to serve, and says with `holds_weights` whether it still holds pushed
weights (SGLang's and vLLM's sleep may free them); it never stores this bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Optional, Sequence

from torch import Tensor, nn

from lit_rlvr.models.lora import is_lora, peft_config_dict
from lit_rlvr.rollout.engine import RolloutEngine, SamplingParams
from lit_rlvr.rollout.lora import (
    SyncCheck,
    adapter_name,
    adapter_tensors,
    base_named_weights,
    check_engine_sync,
    merged_named_weights,
    peft_file_name,
)
from lit_rlvr.rollout.weights import push_named
from lit_rlvr.run.distributed import full_named_weights
from lit_rlvr.run.step_timer import StepTimer


@dataclass
class PushResult:
    """One push: its seconds, the bytes sent (0 to an engine that shares the trainer's weights) and, when the
    post-push check ran, `engine/sync_logp_diff`."""

    seconds: float
    nbytes: int = 0
    metrics: dict[str, Tensor] = field(default_factory=dict)


class WeightSync:
    """What `engine` holds of `policy`, and the pushes that change it (see the module docstring).

    Args:
        engine: the rollout engine (`RolloutEngine`): read for its capabilities and `holds_weights` only.
        policy: the trained model whose weights are pushed (a peft model: its adapters, or merged weights).
        sync_check: the post-push check that a non-shared engine samples the policy (None: off).
        probe: the prompt token ids the check samples after.
    """

    def __init__(self, engine: RolloutEngine, policy: nn.Module, sync_check: Optional[SyncCheck] = None,
                 probe: Sequence[int] = ()):
        self.engine, self.policy, self.sync_check, self.probe = engine, policy, sync_check, list(probe)
        self.version: Optional[int] = None  # version (updates) of the weights pushed last (None: none yet)
        self.holds_mean = False  # those are the mean weights (False: a 3PO sample, or restored since)
        self.base_pushed = False  # the base a LoRA push builds on went out (merged: the unadapted layers too)
        self.adapter: Optional[str] = None  # LoRA `adapter` sync: the adapter pushed last, the engine's default
        self.sample_adapters: list[str] = []  # 3PO's weight samples loaded aside, one adapter each
        self._adapter_pushes = 0  # adapter pushes within `version` (their names must differ: engines cache by name)
        self._checked_pushes = 0  # pushes to a non-shared engine (the post-push check runs every k-th)

    # -- what the engine holds ---------------------------------------------------------------------------------
    def holds(self, step: int) -> bool:
        """Whether the engine samples with the mean weights of version `step` now (no push needed)."""
        return self.holds_mean and self.version == step and self.engine.holds_weights

    def forget(self) -> None:
        """The policy's weights changed outside a push (a checkpoint was restored): push before the next rollout."""
        self.holds_mean = False

    def can_stack_sources(self) -> bool:
        """One engine call may sample several weight sources: the engine stacks them, with the trainer's own model
        or (LoRA) each source as an adapter over one base, whose adapters live whole on this rank."""
        engine, policy = self.engine, self.policy
        as_adapters = (engine.serves_lora and engine.lora_sync == "adapter" and engine.serves_many_adapters
                       and is_lora(policy) and not any(hasattr(p, "full_tensor") for p in policy.parameters()))
        return engine.can_generate_stacked and (engine.shares_weights or as_adapters)

    # -- pushes ------------------------------------------------------------------------------------------------
    def push(self, *, step: int, holds_mean: bool = True) -> PushResult:
        """Send the policy's current weights (nothing to a `shared` engine) as those of `step`; wakes a sleeping
        engine; then the post-push check."""
        timer = StepTimer()
        with timer("sync_s"):
            self.engine.wake()
            nbytes = 0 if self.engine.shares_weights else self._send(step)
            self.version, self.holds_mean = step, holds_mean
        return PushResult(timer.times["sync_s"], nbytes, self._check(step))

    def push_named(self, named: Iterable[tuple[str, Tensor]], *, step: int) -> float:
        """Weights that are not the policy's own (3PO in async mode: a weight sample drawn from a snapshot of the
        posterior; of a LoRA policy, its adapters, sent as `_send` sends the policy's) to an engine that keeps its own
        copy, while it holds `step`; returns the seconds. No post-push check (it would score with the policy, which
        does not hold them), but the push counts toward its cadence, as the synchronous run's push of the same sample
        does."""
        if self.engine.shares_weights:
            raise RuntimeError("WeightSync.push_named sends weights to an engine with its own copy; this engine "
                               "shares the trainer's weights")
        timer = StepTimer()
        with timer("sync_s"):
            self.engine.wake()
            if is_lora(self.policy):
                self._send(step, adapters=dict(named))
            else:
                dtype = self.engine.weight_dtype
                self._load((name, t if dtype is None else t.to(dtype)) for name, t in named)
            self.version, self.holds_mean = step, False
        if self.sync_check is not None and self.sync_check.every:
            self._checked_pushes += 1
        return timer.times["sync_s"]

    def _send(self, step: int, adapters: Optional[dict[str, Tensor]] = None) -> int:
        """The weights themselves; returns the bytes sent. A LoRA policy (lit_rlvr.rollout.lora): on an engine that
        serves adapters, the base once (while the engine holds none), then the adapter under `adapter_name`, which
        becomes the engine's default; otherwise merged weights (the adapted layers only, once the base is there).
        `adapters` ({parameter name: tensor}): adapter values to send instead of the policy's (the frozen base is
        still read from the policy, so the trainer may be changing the adapters meanwhile)."""
        engine, dtype = self.engine, self.engine.weight_dtype
        first = not (self.base_pushed and engine.holds_weights)  # a sleep may have freed what was pushed
        if not is_lora(self.policy):
            nbytes = self._load(full_named_weights(self.policy, dtype))
        elif engine.lora_sync == "adapter" and engine.serves_lora:
            nbytes = self._load(base_named_weights(self.policy, dtype)) if first and engine.adapter_base_by_name else 0
            self._adapter_pushes = self._adapter_pushes + 1 if self.version == step else 0
            self.adapter = adapter_name(step, push=self._adapter_pushes)
            tensors = adapter_tensors(self.policy, dtype) if adapters is None else {
                peft_file_name(name): t if dtype is None else t.to(dtype) for name, t in adapters.items()}
            engine.load_adapter(self.adapter, tensors, peft_config_dict(self.policy))
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        else:
            nbytes = self._load(merged_named_weights(self.policy, dtype, adapters=adapters,
                                                     adapted_only=not first and engine.takes_weight_subsets))
        self.base_pushed = True
        return nbytes

    def _load(self, named: Iterator[tuple[str, Tensor]]) -> int:
        return push_named(self.engine, named, self.engine.bucket_bytes)

    def load_samples(self, stacks: dict[Tensor, Tensor], params_per_source: Sequence[SamplingParams], *,
                     step: int) -> list[SamplingParams]:
        """3PO's weight samples as adapters over the one base (`stacks[p][j]`: sample j of parameter p), loaded
        aside (the mean stays the default); returns each source's params naming its adapter."""
        names = {id(p): n for n, p in self.policy.named_parameters()}
        dtype = self.engine.weight_dtype
        config = peft_config_dict(self.policy)
        self.sample_adapters = []
        for sample in range(len(params_per_source)):
            tensors = {peft_file_name(names[id(p)]): s[sample] if dtype is None else s[sample].to(dtype)
                       for p, s in stacks.items()}
            self.sample_adapters.append(adapter_name(step, sample))
            self.engine.load_adapter(self.sample_adapters[-1], tensors, config, activate=False)
        return [replace(params, adapter=name) for params, name in zip(params_per_source, self.sample_adapters)]

    def check_due(self) -> bool:
        """Whether the next push is followed by the post-push check (it samples with the engine)."""
        check = self.sync_check
        return (not self.engine.shares_weights and check is not None and check.every > 0
                and self._checked_pushes % check.every == 0)

    def _check(self, step: int) -> dict[str, Tensor]:
        """After a push to a non-shared engine, every `sync_check.every`-th: its log-probs of a few sampled tokens
        against the trainer's, as `engine/sync_logp_diff` (`EngineSyncError` above the bound)."""
        check = self.sync_check
        if self.engine.shares_weights or check is None or check.every == 0:
            return {}
        self._checked_pushes += 1
        if (self._checked_pushes - 1) % check.every:
            return {}
        return {"engine/sync_logp_diff": check_engine_sync(self.engine, self.policy, self.probe, check=check,
                                                           version=step)}
