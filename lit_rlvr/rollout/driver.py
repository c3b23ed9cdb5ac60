"""`RolloutDriver`: the generation half of one RL step (DESIGN §3), between the plan and the scored batch.

It asks the engine for the plan's samples weight source by weight source (one stacked call when the engine can),
round after round while the plan's budget rule asks for more, decodes and scores them, and keeps the engine's
weights in step with the policy. `GRPOModule` owns one (`module.driver`) and reads from it nothing but batches.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import Tensor

from lit_rlvr import distributed as D
from lit_rlvr.checkpoint_io import checkpoint_hint
from lit_rlvr.rewards.base import RewardHangError
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts, rollouts_from_completions
from lit_rlvr.rollout.engine import EngineError, SamplingParams
from lit_rlvr.rollout.lora import (can_generate_with_adapters, check_engine_sync, generate_with_adapters,
                                   probe_prompt, push_policy)

if TYPE_CHECKING:  # pragma: no cover
    from lit_rlvr.module import GRPOModule


class RolloutDriver:
    """Generation for `module`: its engine, tokenizer, reward runner, sampling options, step and counters.

    `seed_suffix` is appended to every sampling seed's key (DAPO: refill batches draw from their own stream)."""

    def __init__(self, module: "GRPOModule"):
        self.module = module
        self.holds_mean = False  # whether the engine holds the mean weights of step `engine.version`
        self.seed_suffix: tuple[int, ...] = ()
        self.pushes = 0  # pushes to a non-shared engine so far (the post-push check runs every k-th)

    @property
    def engine(self):
        return self.module.engine

    # -- sampling options --------------------------------------------------------------------------------------
    def sampling_params(self, seed: int, *, evaluation: bool = False) -> SamplingParams:
        hp = self.module.hparams
        temperature = hp.eval_temperature if evaluation else hp.temperature
        return SamplingParams(temperature=temperature, top_p=hp.top_p, top_k=hp.top_k,
                              max_new_tokens=hp.max_new_tokens, seed=seed, stop_token_ids=self.stop_token_ids(),
                              ignore_eos=hp.ignore_eos and not evaluation)

    def stop_token_ids(self) -> tuple[int, ...]:
        """Where sampling stops besides the tokenizer's eos: the eos ids of the model's generation config (e.g. a
        chat model that ends a turn with one token and a document with another)."""
        policy = getattr(self.module, "policy", None)
        eos = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
        if eos is None:  # also while the module checks its options, before the model loads
            return ()
        ids = eos if isinstance(eos, (list, tuple)) else [eos]
        return tuple(sorted({int(i) for i in ids} - {self.module.tokenizer.eos_token_id}))

    def sample_seed(self, *parts: int) -> int:
        """Seed of one engine call: a function of the run seed, the step and the call's place in it. Not of the
        rank: the engine keys each completion by its prompt, so any world size samples the same completions."""
        key = ":".join(str(p) for p in (self.module.hparams.seed, self.module.global_step, *parts, *self.seed_suffix))
        return zlib.crc32(key.encode())

    # -- generation --------------------------------------------------------------------------------------------
    def rollout(self, plan: RolloutPlan) -> Rollouts:
        """Generate and score the plan's samples, round after round while its budget rule asks for more."""
        parts: list[Rollouts] = []
        counts: Optional[list[int]] = plan.n_per_prompt
        have = [0] * plan.num_prompts
        round_index = 0
        while self._another_round(counts):
            counts = counts or [0] * plan.num_prompts  # this rank is done but takes part in the others' pushes
            if any(c < 0 for c in counts):
                raise ValueError(f"budget rule asked for negative sample counts: {counts}")
            per_source = plan.split_over_sources(counts, have)
            if self._can_stack(plan, per_source):
                parts += self._generate_stacked(plan, per_source, round_index)
            else:
                for source, source_counts in enumerate(per_source):
                    part = self._generate(plan, source_counts, source, round_index)
                    if part is not None:
                        parts.append(part)
            have = [h + c for h, c in zip(have, counts)]
            rollouts = Rollouts.concat(parts, self.module.tokenizer.pad_token_id)
            round_index += 1
            counts = plan.budget_rule(rollouts) if plan.budget_rule is not None else None
        self.module.counters["rollouts_total"] += rollouts.num_samples
        self.module.counters["tokens_generated"] += rollouts.num_tokens()
        return rollouts

    @staticmethod
    def _another_round(counts: Optional[list[int]]) -> bool:
        """Whether any rank asks for more samples: weight pushes are collectives, so all ranks run every round."""
        return D.global_max(int(counts is not None and sum(counts) > 0)) > 0

    def _generate(self, plan: RolloutPlan, counts: list[int], source: int, round_index: int) -> Optional[Rollouts]:
        """Samples of one weight source in one round (None when `counts` are all 0; the push still happens)."""
        m = self.module
        with m.timer("gen_s"), plan.weight_context(source):
            mean = plan.uses_mean_weights and plan.num_weight_sources == 1
            if not mean or not self.holds_mean or self.engine.version != m.global_step:
                m.push_to_engine(holds_mean=mean)
            if sum(counts) == 0:
                return None
            params = self.sampling_params(self.sample_seed(round_index, source))
            completions = self.engine_generate(plan.prompt_token_ids, counts, params)
        pad = m.tokenizer.pad_token_id
        return self._score(plan, rollouts_from_completions(plan, completions, source=source, pad_id=pad))

    def _can_stack(self, plan: RolloutPlan, per_source: list[list[int]]) -> bool:
        """One stacked engine call for all weight sources: an engine that has one, sharing the model, and
        equal totals per source (C3PO: G/N per prompt each)."""
        totals = {sum(c) for c in per_source}
        stackable = self.engine.shares_weights or can_generate_with_adapters(self.engine, self.module.policy)
        return (plan.num_weight_sources > 1 and self.engine.can_generate_stacked and stackable
                and len(totals) == 1 and totals != {0})

    def _generate_stacked(self, plan: RolloutPlan, per_source: list[list[int]], round_index: int) -> list[Rollouts]:
        """What `_generate` gives for every source, from one engine call: per-token overhead, not FLOPs, sets
        the cost of a small model's generation, so S calls cost ~S times one (lit_rlvr.rollout.multi_weight)."""
        m = self.module
        with m.timer("gen_s"):
            num = plan.num_weight_sources
            stacks = plan.weight_stacks(num) if plan.weight_stacks is not None else self._stacks_from_contexts(plan)
            m.push_to_engine(holds_mean=False)  # shared mode: no copy; the version bookkeeping of `_generate`
            sampling = [self.sampling_params(self.sample_seed(round_index, s)) for s in range(num)]
            with self.engine_errors():
                if self.engine.shares_weights:
                    completions = self.engine.generate_stacked(plan.prompt_token_ids, per_source, sampling, stacks)
                else:  # LoRA on a multi-adapter engine: N sampled adapters, one call
                    completions = generate_with_adapters(self.engine, m.policy, plan.prompt_token_ids, per_source,
                                                         sampling, stacks, version=m.global_step)
        pad = m.tokenizer.pad_token_id
        packed = [rollouts_from_completions(plan, c, source=s, pad_id=pad) for s, c in enumerate(completions)]
        return [self._score(plan, Rollouts.concat(packed, pad))]  # one decode and one reward call for all sources

    @torch.no_grad()
    def _stacks_from_contexts(self, plan: RolloutPlan) -> dict[Tensor, Tensor]:
        """{param: [S, *shape]}: row s copied from the params inside `plan.weight_context(s)`."""
        params = list(self.engine.model.parameters())
        stacks = {p: p.new_empty((plan.num_weight_sources, *p.shape)) for p in params}
        for source in range(plan.num_weight_sources):
            with plan.weight_context(source):  # 3PO writes θ̂_source into the params; m is back on exit
                for p in params:
                    stacks[p][source].copy_(p)
        return stacks

    def _score(self, plan: RolloutPlan, part: Rollouts) -> Rollouts:
        """Decode the packed completions and score their rewards."""
        m = self.module
        pad = m.tokenizer.pad_token_id
        part.completions = m.tokenizer.batch_decode(part.response_ids.masked_fill(~part.response_mask, pad),
                                                    skip_special_tokens=True)
        with m.timer("reward_s"):
            owners = part.group.tolist()  # [N] prompt of each completion
            scored = m.reward_runner([plan.prompts[g] for g in owners], part.completions,
                                     [plan.answers[g] for g in owners])
            if m.reward_runner.stop_reason:  # a hung call is left running: finish, save, stop
                m.trainer.should_stop = True
            part.rewards, part.malformed = scored.scores, scored.malformed
            m.counters["reward_failures"] += scored.failures
        return part

    def engine_generate(self, prompt_token_ids: list[list[int]], counts: list[int], params: SamplingParams):
        with self.engine_errors():
            return self.engine.generate(prompt_token_ids, counts, params)

    @contextmanager
    def engine_errors(self) -> Iterator[None]:
        """An engine failure becomes an `EngineError` that says what survives and what to do."""
        try:
            yield
        except Exception as err:
            raise EngineError(f"engine {self.module.hparams.engine!r} failed at step {self.module.global_step + 1}: "
                              f"{err!r}; {checkpoint_hint(self.module._trainer)}") from err

    def evaluate(self, plan: RolloutPlan, n: int, seed: int) -> Tensor:
        """[B, n] bool: whether each of n samples per prompt, drawn from the mean weights with the evaluation
        sampling options, is correct."""
        m = self.module
        if not self.holds_mean or self.engine.version != m.global_step:
            m.push_to_engine()
        params = self.sampling_params(seed, evaluation=True)
        completions = self.engine.generate(plan.prompt_token_ids, [n] * plan.num_prompts, params)
        texts = [[m.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in per] for per in completions]
        flat = [t for per in texts for t in per]
        owners = [b for b, per in enumerate(texts) for _ in per]
        scored = m.reward_runner([plan.prompts[b] for b in owners], flat, [plan.answers[b] for b in owners])
        if m.reward_runner.stop_reason:
            raise RewardHangError(f"{m.reward_runner.stop_reason} (in validation)")
        return (scored.scores > 0).view(plan.num_prompts, n)  # [B, n]

    # -- weights -----------------------------------------------------------------------------------------------
    def push(self, *, holds_mean: bool = True) -> None:
        """Send the policy's current weights to the engine (no copy in `shared` mode); wakes a sleeping engine."""
        m = self.module
        with m.timer("sync_s"):
            self.engine.wake()
            if not self.engine.shares_weights:
                push_policy(self.engine, m.policy, version=m.global_step)  # LoRA: adapters or merged (rollout.lora)
            self.engine.version = m.global_step
            self.holds_mean = holds_mean
            self.check_sync()

    def check_sync(self) -> None:
        """After a push to a non-shared engine: its log-probs of a few sampled tokens against the trainer's, as
        `engine/sync_logp_diff`; a gap above the bound raises `EngineSyncError` (rollout.lora.check_engine_sync)."""
        check = getattr(self.engine, "sync_check", None)
        if self.engine.shares_weights or check is None or check.every == 0:
            return
        self.pushes += 1
        if (self.pushes - 1) % check.every == 0:
            m = self.module
            diff = check_engine_sync(self.engine, m.policy, probe_prompt(m.tokenizer), check=check,
                                     version=m.global_step)
            m.log_metrics({"engine/sync_logp_diff": diff})

