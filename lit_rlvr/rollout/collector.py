"""`StepCollector`: one RL step's scored rollouts, from the step's batch (docs/architecture.md §3).

plan (each prompt rendered and tokenized, `group_size` samples each) → the callbacks edit the plan → the driver
generates and scores it; with DAPO's `filter_groups` (lit_rlvr.algorithms.filter_groups) the groups whose metric
is equal are dropped and the batch is refilled from the data stream's next batches. It is built for each step from
explicit parts, like `lit_rlvr.update.Update` on the other side of the step: it reads no module and no trainer,
adds what it generated to the run's counters and the step's timer and token counts, and returns the rollouts with
their metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from torch import Tensor

from lit_rlvr.config.errors import GenerationBudgetError
from lit_rlvr.data.formats import render_prompt
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from lit_rlvr.rollout.driver import RolloutDriver, RolloutResult
from lit_rlvr.rollout.engine import engine_hint
from lit_rlvr.run.counters import RunCounters
from lit_rlvr.run.perf import StepFlops
from lit_rlvr.run.step_timer import StepTimer

Batch = dict[str, list]


def plan_batch(batch: Batch, tokenizer: Any, group_size: int, *, chat_template: bool = False,
               seed_stream: tuple[int, ...] = ()) -> RolloutPlan:
    """The plan of a data batch: its prompts rendered (`formats.render_prompt`) and tokenized, `group_size`
    samples each. `seed_stream` is appended to the seed keys of the plan's engine calls (a refill's own stream)."""
    prompts = [render_prompt(p, tokenizer, chat_template=chat_template) for p in batch["prompt"]]
    token_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    return RolloutPlan(prompts, list(batch["answer"]), token_ids, [group_size] * len(prompts),
                       seed_stream=seed_stream)


@dataclass
class StepCollector:
    """Args: `driver` generates and scores; `tokenizer`, `group_size`, `chat_template` make the plan; `seed_key`
    (run seed, optimizer step) keys the engine's seeds; `version` (the updates so far: the weights the engine is to
    hold, `RolloutSource.version`) and `ahead` (async mode: the batches planned ahead; None: synchronous) go on every
    plan; `counters` (the run's totals), `timer` (the step's phase
    seconds) and `flops` (the step's token counts) are added to; `plan_hooks` edit each plan before
    it is generated (the callbacks' `on_rollout_plan`); `group_filter` (a `GroupFilter`, or None) and `next_batch`
    (the data stream's next batch, or None when it ran out) for DAPO's dynamic sampling; `engine_name` and
    `hint` (what the run keeps and what to do, asked when it fails) complete the errors of an engine or of the
    filter's budget."""

    driver: RolloutDriver
    tokenizer: Any
    group_size: int
    seed_key: tuple
    counters: RunCounters
    timer: StepTimer
    flops: StepFlops
    chat_template: bool = False
    plan_hooks: Sequence[Callable[[RolloutPlan], None]] = ()
    group_filter: Any = None
    next_batch: Callable[[], Optional[Batch]] = lambda: None
    engine_name: str = "hf"
    version: int = 0
    ahead: Optional[int] = None
    hint: Callable[[], str] = lambda: "nothing was saved"
    stop_reason: Optional[str] = None  # a reward call hung: the run should finish this step, save and stop
    metrics: dict[str, Tensor] = field(default_factory=dict)

    def collect(self, batch: Batch) -> tuple[Rollouts, dict[str, Tensor]]:
        """The step's rollouts and metrics: the batch's, or the filter's kept groups refilled from the stream."""
        try:
            with engine_hint(self.engine_name, self.hint):
                if self.group_filter is None:
                    return self.collect_batch(batch), self.metrics
                rollouts, filter_metrics = self.group_filter.collect(batch, self.collect_batch, self.next_batch)
        except GenerationBudgetError as err:  # what the run keeps, and that the cap may change on resume
            raise GenerationBudgetError([f"{err.problems[0]}; {self.hint()} (the cap may change on resume)"]) from err
        return rollouts, {**self.metrics, **filter_metrics}

    def collect_batch(self, batch: Batch, seed_stream: tuple[int, ...] = ()) -> Rollouts:
        """Plan one data batch, let the hooks edit the plan, generate and score it."""
        return self.rollout(self.plan(batch, seed_stream))

    def plan(self, batch: Batch, seed_stream: tuple[int, ...] = ()) -> RolloutPlan:
        """The batch's plan (`plan_batch`), edited by the hooks."""
        plan = plan_batch(batch, self.tokenizer, self.group_size, chat_template=self.chat_template,
                          seed_stream=seed_stream)
        plan.version, plan.ahead = self.version, self.ahead
        for hook in self.plan_hooks:
            hook(plan)
        return plan

    def rollout(self, plan: RolloutPlan) -> Rollouts:
        """The plan's samples, generated and scored (`RolloutDriver.rollout`), counted into the run's totals."""
        return self.count(self.driver.rollout(plan, step=self.version, seed_key=self.seed_key))

    def count(self, result: RolloutResult) -> Rollouts:
        """A driver call's rollouts, its costs added to the run's totals and the step's timer and token counts."""
        result.count_into(self.counters, self.timer)
        self.metrics.update(result.metrics)
        self.stop_reason = self.stop_reason or result.stop_reason
        self.flops.add_generation(result.rollouts)
        return result.rollouts
