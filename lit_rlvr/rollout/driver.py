"""`RolloutDriver`: the generation half of one RL step (docs/architecture.md §3), from a plan to a scored batch.

It asks the engine for the plan's samples weight source by weight source (one stacked call when the engine can),
round after round while the plan's budget rule asks for more, decodes and scores them, and keeps the engine's
weights in step with the policy. With an environment (`env=`), each sample is a multi-turn rollout
(lit_rlvr.rollout.multi_turn): all turns of a weight source's samples run inside its weight context, and the
environment scores them. It is built from explicit parts (engine, tokenizer, reward runner, sampling
options, the policy whose weights it pushes) and called with what changes per step (the plan, the step, the seed
key); it returns the batch with its counts and timings and never reads a module or a trainer.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_rlvr.config.bounds import model_context
from lit_rlvr.config.errors import ConfigError, RewardHangError
from lit_rlvr.envs import Environment
from lit_rlvr.rollout import build_engine
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts, rollouts_from_completions
from lit_rlvr.rollout.engine import Completion, EngineError, RolloutEngine, SamplingConfig, SamplingParams
from lit_rlvr.rollout.lora import SyncCheck, merged_push_problems, probe_prompt
from lit_rlvr.rollout.multi_turn import Episode, MultiTurn, score_episodes
from lit_rlvr.rollout.weight_sync import PushResult, WeightSync
from lit_rlvr.run import distributed as D
from lit_rlvr.run.rng import seed_of
from lit_rlvr.run.step_timer import StepTimer
from lit_rlvr.run.stop import STOP


@dataclass
class RolloutResult:
    """What one `RolloutDriver.rollout` call produced: the scored batch and what it cost."""

    rollouts: Rollouts
    num_rollouts: int  # completions generated (= rollouts.num_samples)
    num_tokens: int  # response tokens generated
    reward_failures: int  # reward calls that crashed or timed out (their rollouts are malformed)
    stop_reason: Optional[str]  # set when a reward call hung: the run should save and stop
    # gen_s, reward_s, sync_s, env_s (sync_s and env_s, the environments' time, are within gen_s)
    seconds: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # the pushes' checks (`engine/sync_logp_diff`)

    def count_into(self, counters: dict[str, int], timer: StepTimer) -> None:
        """Add this call's phase seconds to the step's `timer` and what it generated to the run's `counters`."""
        for phase, seconds in self.seconds.items():
            timer.add(phase, seconds)
        counters["rollouts_total"] += self.num_rollouts
        counters["tokens_generated"] += self.num_tokens
        counters["reward_failures"] += self.reward_failures


@dataclass
class _Tally:
    """What one driver call spends: phase seconds and the post-push checks' metrics."""

    timer: StepTimer = field(default_factory=StepTimer)
    metrics: dict[str, Tensor] = field(default_factory=dict)


def stop_token_ids(policy: nn.Module, eos_token_id: Optional[int]) -> tuple[int, ...]:
    """Where sampling stops besides the tokenizer's eos: the eos ids of the model's generation config (e.g. a chat
    model that ends a turn with one token and a document with another)."""
    eos = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return ()
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return tuple(sorted({int(i) for i in ids} - {eos_token_id}))


class RolloutDriver:
    """Generation and scoring for one policy: see the module docstring.

    Args:
        engine: the rollout engine (`lit_rlvr.rollout.engine.RolloutEngine`).
        tokenizer: decodes completions for the reward; its pad id pads the batch.
        reward_runner: `(prompts, completions, answers) -> RewardResult` (lit_rlvr.rewards).
        sampling: the run's sampling options.
        policy: the trained model, whose weights `push` sends to an engine that keeps its own copy (LoRA: its
            adapters, or the merged weights: lit_rlvr.rollout.lora).
        sync_check: the post-push check that an engine with its own weights samples the policy (None: off).
        environment: multi-turn rollouts with this environment (None: single-turn, scored by `reward_runner`).
        chat_template: observations given as chat messages are rendered with the tokenizer's chat template.
    """

    def __init__(self, engine: RolloutEngine, tokenizer: Any, reward_runner: Any, sampling: SamplingConfig,
                 policy: nn.Module, sync_check: Optional[SyncCheck] = None, environment: Optional[Environment] = None,
                 chat_template: bool = False):
        self.engine, self.tokenizer, self.reward_runner = engine, tokenizer, reward_runner
        self.sampling, self.policy = sampling, policy
        context = model_context(policy, tokenizer)  # multi-turn rollouts stop at the model's last position
        self.multi_turn = (MultiTurn(environment, tokenizer, chat_template=chat_template, context=context)
                           if environment else None)
        probe = probe_prompt(tokenizer) if sync_check is not None and sync_check.every else ()
        self.weight_sync = WeightSync(engine, policy, sync_check, probe)  # what the engine holds; every push

    @classmethod
    def build(cls, engine_name: str, options: dict[str, Any], policy: nn.Module, tokenizer: Any, reward_runner: Any,
              sampling: SamplingConfig, *, environment: Optional[Environment] = None,
              chat_template: bool = False) -> "RolloutDriver":
        """The engine `engine_name` built with its `options` (`lit_rlvr.rollout.build_engine`; they may hold the
        driver's post-push check, `SyncCheck`), refused before any rollout if it cannot take this policy's merged
        pushes, and its driver."""
        options = dict(options)
        sync_check = SyncCheck.take_from(options)  # the driver's post-push check, not the engine's option
        engine = build_engine(engine_name, policy, tokenizer, options)
        problems = merged_push_problems(engine, policy)
        ConfigError.check(problems)
        return cls(engine, tokenizer, reward_runner, sampling, policy, sync_check, environment=environment,
                   chat_template=chat_template)

    # -- generation --------------------------------------------------------------------------------------------
    def rollout(self, plan: RolloutPlan, *, step: int, seed_key: tuple, group: Optional[dist.ProcessGroup] = None,
                push_policy: bool = True) -> RolloutResult:
        """Generate and score the plan's samples, round after round while its budget rule asks for more.

        `step` is the version of the policy's weights (its updates so far, `RolloutSource.version`, which a push
        makes the engine's); the engine call of round r and weight source s samples with
        `seed_of(*seed_key, r, s, *plan.seed_stream)`. `group`: the process group of the ranks' agreement on rounds
        (None: the default; async rollouts' producer thread has its own, `distributed.thread_group`).
        `push_policy=False`: the engine's weights are the caller's business, and the policy is never pushed from here
        (async rollouts: the producer's thread must not read the trainer's parameters; only weights drawn into the
        plan are pushed)."""
        tally = _Tally()
        parts: list[Rollouts] = []
        counts: Optional[list[int]] = plan.n_per_prompt
        have = [0] * plan.num_prompts
        failures, round_index = 0, 0
        while self._another_round(plan, counts, round_index, group):
            STOP.check()  # a stop request past its grace abandons the step between engine calls
            counts = counts or [0] * plan.num_prompts  # this rank is done but takes part in the others' pushes
            if any(c < 0 for c in counts):
                raise ValueError(f"budget rule asked for negative sample counts: {counts}")
            per_source = plan.split_over_sources(counts, have)
            seeds = [seed_of(*seed_key, round_index, s, *plan.seed_stream) for s in range(len(per_source))]
            if self._can_stack(plan, per_source):
                new = iter([self._generate_stacked(plan, per_source, seeds, step, tally)])
            else:  # lazily: each source's samples are scored before the next source generates
                new = (self._generate(plan, c, source, seeds[source], step, tally, push_policy)
                       for source, c in enumerate(per_source))
            for part in new:
                STOP.check()
                if part is not None:
                    failures += self._score(plan, part, tally.timer)
                    parts.append(part)
            have = [h + c for h, c in zip(have, counts)]
            rollouts = Rollouts.concat(parts, self.tokenizer.pad_token_id)
            round_index += 1
            counts = plan.budget_rule(rollouts) if plan.budget_rule is not None else None
        tally.metrics.update(self._reward_metrics())  # per reward term: reward/<name>/mean, .../failures
        tally.metrics.update({k: torch.tensor(float(v)) for k, v in self.engine.take_metrics().items()})
        return RolloutResult(rollouts, rollouts.num_samples, rollouts.num_tokens(), failures,
                             self.reward_runner.stop_reason, tally.timer.times, tally.metrics)

    def _reward_metrics(self) -> dict[str, Tensor]:
        """What the reward runner tallied since the last take (a weighted reward's per-term means and failures)."""
        take = getattr(self.reward_runner, "take_metrics", None)
        return {k: torch.tensor(float(v)) for k, v in take().items()} if take is not None else {}

    @staticmethod
    def _another_round(plan: RolloutPlan, counts: Optional[list[int]], round_index: int,
                       group: Optional[dist.ProcessGroup] = None) -> bool:
        """Whether any rank asks for more samples: weight pushes are collectives, so all ranks run every round.
        A plan without a budget rule has one round on every rank: nothing to agree on (no collective, so async
        rollouts' producers on several ranks never wait for one another)."""
        if plan.budget_rule is None:
            return round_index == 0
        return D.global_max(int(counts is not None and sum(counts) > 0), group) > 0

    def _generate(self, plan: RolloutPlan, counts: list[int], source: int, seed: int, step: int,
                  tally: _Tally, push_policy: bool = True) -> Optional[Rollouts]:
        """Samples of one weight source in one round (None when `counts` are all 0; the push still happens)."""
        with tally.timer("gen_s"), plan.weight_context(source):
            mean = plan.uses_mean_weights and plan.num_weight_sources == 1
            if plan.source_weights is not None:  # drawn when the plan was made: the policy is not read
                with self._engine_errors(step):
                    tally.timer.add("sync_s", self.weight_sync.push_named(plan.source_weights(source), step=step))
            elif push_policy and (not mean or not self.weight_sync.holds(step)):
                self._tallied_push(step, mean, tally)
            if sum(counts) == 0:
                return None
            if self.multi_turn is not None:  # every turn of this source's rollouts, inside its weight context
                episodes = self._run_episodes(plan, counts, self.sampling.params(seed), step, tally.timer)
            else:
                with self._engine_errors(step):
                    completions = self.engine.generate(plan.prompt_token_ids, counts, self.sampling.params(seed))
        if self.multi_turn is None:
            return rollouts_from_completions(plan, completions, source=source, pad_id=self.tokenizer.pad_token_id)
        packed = [[e.completion() for e in episodes if e.group == b] for b in range(plan.num_prompts)]
        part = rollouts_from_completions(plan, packed, source=source, pad_id=self.tokenizer.pad_token_id)
        score_episodes(part, episodes, self.tokenizer)
        return part

    def _run_episodes(self, plan: RolloutPlan, counts: list[int], params: SamplingParams, step: int,
                      timer: Optional[StepTimer] = None) -> list[Episode]:
        """The multi-turn rollouts of `counts` (prompt after prompt); engine failures become `EngineError`s."""
        def generate(prompts: list[list[int]], n: list[int], turn_params: SamplingParams) -> list[list[Completion]]:
            with self._engine_errors(step):
                return self.engine.generate(prompts, n, turn_params)

        episodes = self.multi_turn.run(generate, plan.prompt_token_ids, plan.prompts, plan.answers, counts, params)
        if timer is not None:
            timer.add("env_s", self.multi_turn.env_seconds)
        self.multi_turn.env_seconds = 0.0
        return episodes

    def _can_stack(self, plan: RolloutPlan, per_source: list[list[int]]) -> bool:
        """One stacked engine call for all weight sources: an engine that has one, sharing the model, and
        equal totals per source (C3PO: G/N per prompt each)."""
        totals = {sum(c) for c in per_source}
        return (plan.num_weight_sources > 1 and plan.source_weights is None and self.weight_sync.can_stack_sources()
                and self.multi_turn is None  # multi-turn: one source after another
                and len(totals) == 1 and totals != {0})

    def _generate_stacked(self, plan: RolloutPlan, per_source: list[list[int]], seeds: list[int], step: int,
                          tally: _Tally) -> Rollouts:
        """What `_generate` gives for every source, from one engine call: per-token overhead, not FLOPs, sets
        the cost of a small model's generation, so S calls cost ~S times one (lit_rlvr.rollout.multi_weight)."""
        with tally.timer("gen_s"):
            num = plan.num_weight_sources
            stacks = plan.weight_stacks(num) if plan.weight_stacks is not None else self._stacks_from_contexts(plan)
            # the policy holds the mean (the samples are in `stacks`): shared mode copies nothing, adapter mode
            # sends the mean adapter, and the sampled ones go aside below
            self._tallied_push(step, True, tally)
            sampling = [self.sampling.params(s) for s in seeds]
            with self._engine_errors(step):
                if self.engine.shares_weights:
                    completions = self.engine.generate_stacked(plan.prompt_token_ids, per_source, sampling, stacks)
                else:  # LoRA on a multi-adapter engine: N sampled adapters, one call
                    sampling = self.weight_sync.load_samples(stacks, sampling, step=step)
                    completions = self.engine.generate_stacked(plan.prompt_token_ids, per_source, sampling, None)
        pad = self.tokenizer.pad_token_id
        packed = [rollouts_from_completions(plan, c, source=s, pad_id=pad) for s, c in enumerate(completions)]
        return Rollouts.concat(packed, pad)  # one decode and one reward call for all sources

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

    def _score(self, plan: RolloutPlan, part: Rollouts, timer: StepTimer) -> int:
        """Decode the packed completions and score them in place; returns the number of failed reward calls."""
        if part.transcripts:  # multi-turn: its environment scored it; rewards that broke the contract count
            return sum(t.reward_error is not None for t in part.transcripts)
        pad = self.tokenizer.pad_token_id
        part.completions = self.tokenizer.batch_decode(part.response_ids.masked_fill(~part.response_mask, pad),
                                                       skip_special_tokens=True)
        with timer("reward_s"):
            owners = part.group.tolist()  # [N] prompt of each completion
            scored = self.reward_runner([plan.prompts[g] for g in owners], part.completions,
                                        [plan.answers[g] for g in owners])
            part.rewards, part.malformed = scored.scores, scored.malformed
        return scored.failures

    @contextmanager
    def _engine_errors(self, step: int) -> Iterator[None]:
        """An engine failure becomes an `EngineError` naming the step (the module adds what to do)."""
        try:
            yield
        except EngineError:
            raise
        except Exception as err:
            raise EngineError(f"failed at step {step + 1}: {err!r}") from err

    def evaluate(self, plan: RolloutPlan, n: int, *, step: int, seed: int) -> Tensor:
        """[B, n] bool: whether each of n samples per prompt, drawn from the mean weights of `step` with the
        evaluation sampling options, is correct."""
        if not self.weight_sync.holds(step):
            self.push(step=step)
        params = self.sampling.params(seed, evaluation=True)
        if self.multi_turn is not None:  # correct: the environment's reward is positive
            episodes = self._run_episodes(plan, [n] * plan.num_prompts, params, step)
            correct = [e.reward > 0 and e.transcript.error is None for e in episodes]
            return torch.tensor(correct).view(plan.num_prompts, n)
        with self._engine_errors(step):
            completions = self.engine.generate(plan.prompt_token_ids, [n] * plan.num_prompts, params)
        texts = [[self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in per] for per in completions]
        flat = [t for per in texts for t in per]
        owners = [b for b, per in enumerate(texts) for _ in per]
        scored = self.reward_runner([plan.prompts[b] for b in owners], flat, [plan.answers[b] for b in owners])
        self._reward_metrics()  # an evaluation's per-term tallies are not the next training step's
        if self.reward_runner.stop_reason:
            raise RewardHangError(f"{self.reward_runner.stop_reason} (in validation)")
        return (scored.scores > 0).view(plan.num_prompts, n)  # [B, n]

    # -- weights -----------------------------------------------------------------------------------------------
    def push(self, *, step: int, holds_mean: bool = True) -> PushResult:
        """Send the policy's current weights to the engine as those of `step` (`WeightSync.push`). Every push of
        the run goes through here, so a test can wrap it."""
        with self._engine_errors(step):
            return self.weight_sync.push(step=step, holds_mean=holds_mean)

    def _tallied_push(self, step: int, holds_mean: bool, tally: _Tally) -> None:
        """A push inside a rollout: its seconds and its check go to the call's tally."""
        pushed = self.push(step=step, holds_mean=holds_mean)
        tally.timer.add("sync_s", pushed.seconds)
        tally.metrics.update(pushed.metrics)
