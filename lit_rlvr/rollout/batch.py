"""The rollout batch (`Rollouts`) and the plan that produces it (`RolloutPlan`).

Shapes: B prompts in the step, N completions in all (N = B·G for a plain group of G; V0.5 may give prompts
different counts), P prompt tokens (left-padded), T response tokens (right-padded).
Mask convention: True = the token counts. `response_mask` says what counts in the loss (the model's sampled
tokens), `response_attention_mask` what is in the sequence (sampled and observation tokens; False = padding): the
forward attends to and positions by the second, every loss term, normaliser, ratio, KL and entropy uses the first.
Single-turn rollouts have no observation tokens: the two are equal.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from lit_rlvr.rollout.engine import Completion


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token id lists -> ids [R, P] long, mask [R, P] bool (one tensor build, no per-row copies)."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)
    ids = ids.view(len(sequences), width)  # also [R, 0] when every sequence is empty
    lengths = torch.tensor([len(s) for s in sequences])  # [R]
    mask = torch.arange(width - 1, -1, -1) < lengths[:, None]  # [R, P]: the last len(s) positions
    return ids, mask


@dataclass
class Transcript:
    """One multi-turn rollout's turns, for logs and metrics (lit_rlvr.rollout.multi_turn)."""

    turns: list[tuple[str, str]] = field(default_factory=list)  # (role, text): "assistant" or "observation"
    tool_calls: int = 0  # steps that ran a tool
    error: Optional[str] = None  # the environment raised or hung: malformed, nothing trained on
    cut: Optional[str] = None  # "max_turns" | "max_tokens": a limit ended it before the environment did
    reward_error: Optional[str] = None  # a step's reward broke the reward contract: malformed, counted
    close_error: Optional[str] = None  # its environment's close() raised or hung (counted; the rollout is kept)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "turns": [{"role": r, "text": t} for r, t in self.turns]}


@dataclass
class Rollouts:
    """N completions of B prompts, flat, with `group` telling which prompt each came from."""

    prompt_ids: Tensor  # [N, P] long, left-padded with the pad id
    prompt_mask: Tensor  # [N, P] bool, True = real prompt token
    response_ids: Tensor  # [N, T] long, right-padded
    response_mask: Tensor  # [N, T] bool, True = generated token that counts in the loss
    old_logp: Tensor  # [N, T] float, behaviour log-prob of each sampled token (logits / temperature)
    group: Tensor  # [N] long in [0, B): the prompt each completion answers
    source: Tensor  # [N] long: the weight source (3PO: weight sample) that generated it (0 when there is one)
    num_groups: int  # B
    prompts: list[str]  # [B] prompt texts
    answers: list[Any]  # [B] reference answers for the reward
    completions: list[str] = field(default_factory=list)  # [N] decoded response texts
    finish_reason: list[str] = field(default_factory=list)  # [N] "stop" | "length"
    rewards: Optional[Tensor] = None  # [N] float
    malformed: Optional[Tensor] = None  # [N] bool: no answer could be read, or the reward failed
    baseline: Optional[Tensor] = None  # [B] float: per-group baseline set by a callback (V0.5); None = group mean
    # [B] bool: the prompts whose advantages count, set by a callback (boundary gating: False = no policy gradient
    # from that prompt); None = all
    update_groups: Optional[Tensor] = None
    advantages: Optional[Tensor] = None  # [N] float
    loss_pass: Optional[Tensor] = None  # [N] long: sample index of the loss pass (M3PO); None = one pass
    # [N] long: advantage group set by a callback (M3PO: prompt × source); None = group
    adv_group: Optional[Tensor] = None
    # [N, T] float: factor on each token's loss term, set for the update by the rollout correction (truncated IS
    # weight × rejection mask, 0 = rejected); None = 1
    token_weights: Optional[Tensor] = None
    # [N, T] bool, True = a token in the sequence (sampled or observation); None at construction = `response_mask`
    response_attention_mask: Optional[Tensor] = None
    transcripts: list[Transcript] = field(default_factory=list)  # [N] multi-turn rollouts' turns; [] = single-turn
    # [N] long: the version (updates, i.e. RL steps) of the weights that generated each completion
    # (rollout.mode=async); None = the step that trains it (synchronous)
    policy_version: Optional[Tensor] = None
    # [N, T] long, with partial rollouts (rollout.partial_rollout=true): the version of the weights that drew each
    # token (a completion that spans a push has several; 0 past its end); None otherwise
    token_version: Optional[Tensor] = None
    # [N] long each, with 3PO in async mode: the generating weight sample's index j and the seed of its noise's
    # first parameter, `sample_seed(seed, t, j, rank, 0)` (lit_rlvr.optim; t: IVON's steps when the plan was made,
    # = policy_version unless a non-finite step was skipped); None otherwise
    sample_index: Optional[Tensor] = None
    sample_seed: Optional[Tensor] = None
    # [N] long, with V0.5 in async mode: the version of the prior's context (updates whose records it held) that
    # predicted the prior and allocated the samples; None otherwise
    prior_version: Optional[Tensor] = None
    # async mode: the notes callbacks left on the batch's plan (`RolloutPlan.notes`); None = synchronous
    plan_notes: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.response_attention_mask is None:
            self.response_attention_mask = self.response_mask.clone()

    @property
    def num_samples(self) -> int:
        return self.response_ids.shape[0]

    def group_sizes(self) -> Tensor:
        """[B] long: completions per prompt."""
        return torch.bincount(self.group, minlength=self.num_groups)

    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def advantage_groups(self) -> tuple[Tensor, int]:
        """([N] long ids, count) of the groups advantages are relative to: `adv_group` when a callback set it,
        else the prompt. A per-prompt `baseline` only fits the prompt groups."""
        if self.adv_group is None:
            return self.group, self.num_groups
        if self.baseline is not None:
            raise ValueError("Rollouts.baseline is per prompt ([B]) but adv_group splits prompts into smaller "
                             "advantage groups: a callback set both (e.g. V0.5 with M3PO, which do not compose)")
        return self.adv_group, int(self.adv_group.max()) + 1 if self.num_samples else 0

    def select(self, index: Tensor) -> "Rollouts":
        """The completions at `index` ([M] long); group ids and per-prompt lists are kept as they are."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            per_sample = isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == self.num_samples
            if per_sample and f.name not in ("baseline", "update_groups"):
                value = value[index]
            elif f.name in ("completions", "finish_reason", "transcripts") and value:
                value = [value[i] for i in index.tolist()]
            out[f.name] = value
        return Rollouts(**out)

    def trim_padding(self) -> "Rollouts":
        """The same rows without the padding columns that no row uses: those left of the longest prompt and
        right of the last response token any row counts. The loss does not change (those positions are
        masked out); the forward is narrower (token-budget micro-batches)."""
        prompt_used = self.prompt_mask.any(0)  # [P] columns some row's prompt uses (left-padded)
        response_used = self.response_attention_mask.any(0)  # [T] columns some row's sequence uses
        start = int(prompt_used.long().argmax()) if bool(prompt_used.any()) else self.prompt_mask.shape[1]
        end = int(response_used.nonzero().max()) + 1 if bool(response_used.any()) else 1
        return replace(self, prompt_ids=self.prompt_ids[:, start:], prompt_mask=self.prompt_mask[:, start:],
                       response_ids=self.response_ids[:, :end], response_mask=self.response_mask[:, :end],
                       old_logp=self.old_logp[:, :end],
                       token_weights=None if self.token_weights is None else self.token_weights[:, :end],
                       response_attention_mask=self.response_attention_mask[:, :end])

    def select_groups(self, keep: Tensor) -> "Rollouts":
        """The completions of the prompts where `keep` ([B] bool) is True; groups are renumbered 0..B'−1 and
        the per-prompt fields (prompts, answers, baseline, update_groups) cut to match."""
        keep = keep.bool()  # [B]
        new_id = keep.long().cumsum(0) - 1  # [B] position of each kept prompt
        out = self.select(torch.nonzero(keep[self.group]).squeeze(-1))
        out.group = new_id[out.group]  # [M]
        out.num_groups = int(keep.sum())
        out.prompts = [p for p, k in zip(self.prompts, keep.tolist()) if k]
        out.answers = [a for a, k in zip(self.answers, keep.tolist()) if k]
        out.baseline = None if self.baseline is None else self.baseline[keep]
        out.update_groups = None if self.update_groups is None else self.update_groups[keep]
        return out

    @staticmethod
    def stack_groups(parts: list["Rollouts"], pad_id: int) -> "Rollouts":
        """Join rollouts of *different* prompts (e.g. batches drawn one after another) into one batch whose
        groups are numbered part after part; `concat` is for parts of the same prompts."""
        offsets = torch.tensor([0] + [p.num_groups for p in parts]).cumsum(0).tolist()
        shifted = [replace(p, group=p.group + off) for p, off in zip(parts, offsets)]
        baselines = [p.baseline for p in parts]
        return replace(
            Rollouts.concat(shifted, pad_id),
            num_groups=offsets[-1],
            prompts=sum((p.prompts for p in parts), []),
            answers=sum((p.answers for p in parts), []),
            baseline=None if any(b is None for b in baselines) else torch.cat(baselines),
        )

    @staticmethod
    def concat(parts: list["Rollouts"], pad_id: int) -> "Rollouts":
        """Join rollouts of the same B prompts (e.g. several weight samples or rounds) into one batch."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]

        def cat(name: str, left: bool = False, value: float | bool | int = 0) -> Tensor:
            tensors = [getattr(p, name) for p in parts]
            width = max(t.shape[1] for t in tensors)
            padded = []
            for t in tensors:
                pad = width - t.shape[1]
                filler = torch.full((t.shape[0], pad), value, dtype=t.dtype)
                padded.append(torch.cat([filler, t] if left else [t, filler], dim=1))
            return torch.cat(padded)

        def cat_optional(name: str) -> Optional[Tensor]:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else torch.cat(values)

        return replace(
            first,
            prompt_ids=cat("prompt_ids", left=True, value=pad_id),
            prompt_mask=cat("prompt_mask", left=True, value=False),
            response_ids=cat("response_ids", value=pad_id),
            response_mask=cat("response_mask", value=False),
            response_attention_mask=cat("response_attention_mask", value=False),
            old_logp=cat("old_logp", value=0.0),
            group=torch.cat([p.group for p in parts]),
            source=torch.cat([p.source for p in parts]),
            completions=sum((p.completions for p in parts), []),
            finish_reason=sum((p.finish_reason for p in parts), []),
            transcripts=sum((p.transcripts for p in parts), []),
            rewards=cat_optional("rewards"),
            malformed=cat_optional("malformed"),
            advantages=None,
            loss_pass=cat_optional("loss_pass"),
            adv_group=cat_optional("adv_group"),
            token_weights=None,
            policy_version=cat_optional("policy_version"),
            token_version=(cat("token_version") if all(p.token_version is not None for p in parts) else None),
            sample_index=cat_optional("sample_index"),
            sample_seed=cat_optional("sample_seed"),
            prior_version=cat_optional("prior_version"),
        )


WeightContext = Callable[[int], AbstractContextManager]
"""`weight_context(c)`: a context manager inside which the policy holds the weights of source c."""

SourceWeights = Callable[[int], Iterable[tuple[str, Tensor]]]
"""`source_weights(c)`: (HF name, tensor) pairs of the weights source c generates with, fixed when the plan was made
(3PO in async mode: samples of a snapshot of the posterior); pushed to an engine that keeps its own copy."""

WeightStacks = Callable[[int], dict[Any, Tensor]]
"""`weight_stacks(S)`: {policy parameter: [S, *shape] tensor}, row c = the weights `weight_context(c)` holds,
computed without writing the parameters (optional: a faster way to the stacks of a stacked engine call)."""

BudgetRule = Callable[[Rollouts], Optional[list[int]]]
"""Called after each round with everything generated so far; returns extra samples per prompt ([B] ints)
for the next round, or None to stop."""


def _no_weight_change(_: int) -> AbstractContextManager:
    return nullcontext()


@dataclass
class RolloutPlan:
    """What to generate this step. Callbacks edit it in `on_rollout_plan` (C3PO sets the weight sources,
    V0.5 the first round's counts and the budget rule); edits by two callbacks compose."""

    prompts: list[str]  # [B]
    answers: list[Any]  # [B]
    prompt_token_ids: list[list[int]]  # [B] token ids of each prompt
    n_per_prompt: list[int]  # [B] samples of the first round
    num_weight_sources: int = 1  # weight samples the counts are split over (C3PO: N)
    weight_context: WeightContext = _no_weight_change
    weight_stacks: Optional[WeightStacks] = None
    source_weights: Optional[SourceWeights] = None  # set: the policy is neither read nor written to generate
    source_seeds: Optional[list[int]] = None  # [S] with `source_weights`: each one's seed (`Rollouts.sample_seed`)
    budget_rule: Optional[BudgetRule] = None
    seed_stream: tuple[int, ...] = ()  # appended to each engine call's seed key (DAPO: one stream per refill)
    version: int = 0  # the updates (RL steps) made when the plan was made
    # rollout.mode=async: batches the producer holds ahead of the one trained (`RolloutConfig.lead`); a plan hook's
    # draws and what it keeps for the step's end must then travel with the plan. None = synchronous
    ahead: Optional[int] = None
    # what callbacks keep from this plan to the end of the step that trains it, by callback (async mode: a batch
    # planned ahead keeps its own; the module hands them on as `Rollouts.plan_notes`)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def uses_mean_weights(self) -> bool:
        """False when a callback installed a weight context (3PO): the engine then needs a push per source,
        even with one source, and no longer holds the mean afterwards."""
        return self.weight_context is _no_weight_change and self.source_weights is None

    def split_over_sources(self, counts: list[int], offset: Optional[list[int]] = None) -> list[list[int]]:
        """Split per-prompt counts over the weight sources as evenly as possible.

        Returns [S][B] counts. `offset[b]` (samples prompt b already has) rotates who gets the remainder, so
        counts stay balanced over rounds.
        """
        sources = self.num_weight_sources
        offset = offset or [0] * len(counts)
        out = [[0] * len(counts) for _ in range(sources)]
        for b, (k, start) in enumerate(zip(counts, offset)):
            for i in range(k):
                out[(start + i) % sources][b] += 1
        return out


def rollouts_from_completions(
    plan: RolloutPlan, completions: list[list["Completion"]], *, source: int, pad_id: int
) -> Rollouts:
    """Pack the engine's per-prompt completions into a flat `Rollouts` (texts are decoded by the caller)."""
    owners = [b for b, per_prompt in enumerate(completions) for _ in per_prompt]
    flat = [c for per_prompt in completions for c in per_prompt]
    group = torch.tensor(owners, dtype=torch.long)  # [N]
    prompt_ids, prompt_mask = left_pad(plan.prompt_token_ids, pad_id)  # [B, P]
    prompt_ids, prompt_mask = prompt_ids[group], prompt_mask[group]  # [N, P]
    lengths = torch.tensor([len(c.token_ids) for c in flat], dtype=torch.long)  # [N]
    width = max(int(lengths.max()) if flat else 0, 1)
    present = torch.arange(width) < lengths[:, None]  # [N, T]
    response_ids = torch.full((len(flat), width), pad_id, dtype=torch.long)  # [N, T]
    old_logp = torch.zeros((len(flat), width))  # [N, T]
    response_mask = present.clone()  # [N, T]
    versions = None  # [N, T]: each token's weights' tag, when the engine tagged every completion
    if flat and all(c.versions is not None for c in flat):
        versions = torch.zeros((len(flat), width), dtype=torch.long)
        versions[present] = torch.cat([c.versions for c in flat])
    if flat:  # one scatter of all rows' tokens into the right-padded grid
        response_ids[present] = torch.cat([c.token_ids for c in flat])
        old_logp[present] = torch.cat([c.logprobs for c in flat]).float()
        if any(c.token_mask is not None for c in flat):  # multi-turn: observation tokens do not count
            response_mask[present] = torch.cat([c.token_mask if c.token_mask is not None
                                                else torch.ones(len(c.token_ids), dtype=torch.bool) for c in flat])
    return Rollouts(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        old_logp=old_logp,
        response_attention_mask=present,
        group=group,
        source=torch.full((len(flat),), source, dtype=torch.long),
        num_groups=plan.num_prompts,
        prompts=plan.prompts,
        answers=plan.answers,
        finish_reason=[c.finish_reason for c in flat],
        token_version=versions,
    )
