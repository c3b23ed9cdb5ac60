"""`GRPOModule`: the LightningModule of one RL step (docs/architecture.md §3).

plan → rollout and reward → advantages → update → engine weight sync. Generation (engine calls, rounds, weight
pushes, scoring) is the `RolloutDriver`'s (lit_rlvr.rollout.driver); the update (loss passes over micro-batches,
optimizer steps) is the `Update`'s (lit_rlvr.update), built from the module's parts for each step; the optimizer is
built in lit_rlvr.optim. Subclass points: `compute_advantages`, `policy_loss`, `configure_optimizers`.
Methods that change the plan, the baseline or the weights the gradient is taken at are `RLVRCallback`s
(lit_rlvr.hooks).
"""

from __future__ import annotations

import copy
import functools
import logging
from contextlib import contextmanager
from dataclasses import fields, replace
from typing import Any, Callable, Iterator, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lit_rlvr import functional as F
from lit_rlvr.algorithms.filter_groups import FilterGroups, GroupFilter
from lit_rlvr.config.bounds import check_bounds, model_context, response_budget
from lit_rlvr.config.errors import ConfigError, GenerationBudgetError, NonFiniteError, RewardHangError
from lit_rlvr.config.settings import AlgorithmConfig
from lit_rlvr.config.settings import FilterGroups as SettingsFilterGroups
from lit_rlvr.config.options import compile_problems, consistency_problems, finite_problems, range_problems
from lit_rlvr.data.formats import render_prompt
from lit_rlvr.envs import build_environment
from lit_rlvr.hooks import RLVRCallback, check_rl_callbacks
from lit_rlvr.models import load_policy
from lit_rlvr.models.lora import LoraOptions, apply_lora, trainable_parameters
from lit_rlvr.models.warmup import resolve_model_path
from lit_rlvr.optim.build import build_optimizer, check_optimizer_options
from lit_rlvr.optim.schedule import warmup_factor
from lit_rlvr.rewards import build_reward_runner, reward_problems
from lit_rlvr.rollout import build_engine
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from lit_rlvr.rollout.driver import RolloutDriver, stop_token_ids
from lit_rlvr.rollout.engine import EngineError, SamplingConfig
from lit_rlvr.rollout.lora import SyncCheck, merged_push_problems
from lit_rlvr.rollout.multi_turn import env_metrics
from lit_rlvr.run import distributed as D
from lit_rlvr.run.adapter_export import AdapterExport
from lit_rlvr.run.checkpoint_io import checkpoint_hint
from lit_rlvr.run.freeze import FreezeSetupObjects
from lit_rlvr.run.one_line import config_phase
from lit_rlvr.run.perf import StepFlops, recomputes_forward
from lit_rlvr.run.rng import rng_states, seed_of, set_rng_states
from lit_rlvr.run.step_log import StepTimer, write_step_metrics
from lit_rlvr.run.validation import ValidationMetrics
from lit_rlvr.update import SEQUENCE_METRICS, TOKEN_METRICS, RolloutCorrector, Update

log = logging.getLogger(__name__)


# the module's dict arguments and their train.py keys (every float in them must be finite: lit_rlvr.config.options)
NESTED_OPTIONS = {"model_options": "model.options", "lora": "model.lora", "reward_options": "reward.options",
                  "engine_options": "engine.options", "env_options": "env", "perf_options": "perf",
                  "optimizer_options": "algorithm.optimizer_options",
                  "rollout_correction": "algorithm.rollout_correction", "filter_groups": "algorithm.filter_groups"}


class GRPOModule(pl.LightningModule):
    """GRPO with PPO-clip (Shao et al. 2024) and the usual knobs; docs/architecture.md §4 has the equations.

    Args (the ones a user changes most): `model` an HF path or hub name, or "tiny" (the built-in model, warm-started
    and cached); `reward` a built-in name (`lit_rlvr.rewards.REWARDS`), "package.module:function", or the callable
    `fn(prompt, completion, answer) -> score` itself; `group_size` G samples per prompt; `lr`; `eps_low`/`eps_high` clip
    range; `dual_clip` c (> 1: verl's clip_ratio_c; None = off); `seq_mask_tau` τ of the sequence-level
    importance mask (3PO; None = off); `policy_loss` a name of `functional.POLICY_LOSSES` (`ppo_clip`, `gspo`);
    `advantages` a name of `functional.ADVANTAGES` (`grpo`, `dr_grpo`); `loss_aggregation` (one of
    `functional.AGGREGATIONS`); `scale_adv_by_std`; `filter_groups` verl's dynamic-sampling options (DAPO;
    `algorithms.FilterGroups`); `overlong_cache_len` (0 = off) and `overlong_penalty_factor`: DAPO's overlong reward
    shaping (`compute_advantages`); `kl_coef` β (> 0 loads a frozen reference copy) with
    `kl_estimator` (and `kl_k3_cap`: verl caps k3 at 10; None = no cap); `entropy_coef` η; `ppo_epochs` passes
    over each rollout batch; `mini_batches` optimizer steps per epoch; `micro_batch_size` completions per
    forward/backward; `micro_batch_tokens` (None = off) packs completions of similar length into micro-batches of
    at most that many padded tokens, prompt included (`functional.micro_batches`). `ignore_eos` (benchmarks):
    training completions run to `max_new_tokens` whatever they sample. `warmup_steps` W: linear lr
    warm-up over the first W optimizer updates (`warmup_from_zero`: verl's shape, from lr 0).
    `optimizer`: `adamw` (uses `betas`, `weight_decay`) or `ivon` (`lit_rlvr.optim.IVON`, for 3PO; `lr` plus
    `optimizer_options`: ess λ (required), hess_init, beta1, beta2, weight_decay δ, clip_radius, …); extra
    `optimizer_options` go to the optimizer's constructor either way. `lora`: adapters only (`models.lora`).
    `rollout_correction`: verl's options for the engine's drift (`lit_rlvr.config.rollout_correction`). `perf_options`
    (config `perf`): `peak_flops`, the device's peak FLOP/s that `perf/mfu_*` divide by (None: measured on a CPU,
    published on a GPU; `lit_rlvr.run.perf`), and `cache_dir`, where a CPU's measured peak is kept.
    `compile_update` (config `model.compile`): the update's forward and backward run through
    `torch.compile(policy, dynamic=True)`, compiled at the first update (a minute on a CPU; docs/mfu.md); sampling,
    the reference model and π_old's forward stay eager. Not with FSDP.
    `env`: multi-turn rollouts with an
    environment (`lit_rlvr.envs`; None or "none": single-turn), `env_options` its `max_turns`, `max_tokens`,
    `timeout_s`, `stop` and the environment class's `options` (docs/environments.md).
    """

    # loss metrics that are means over response tokens, and over sequences (a subclass may move one)
    token_metrics, sequence_metrics = TOKEN_METRICS, SEQUENCE_METRICS

    def __init__(
        self,
        model: str = "tiny",
        model_options: Optional[dict[str, Any]] = None,
        dtype: str = "float32",
        lora: Optional[dict[str, Any]] = None,
        reward: Union[str, Callable[..., Any]] = "arithmetic",
        reward_options: Optional[dict[str, Any]] = None,
        engine: str = "hf",
        engine_options: Optional[dict[str, Any]] = None,
        group_size: int = 8,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        warmup_from_zero: bool = False,
        grad_clip: float = 1.0,
        optimizer: str = "adamw",
        optimizer_options: Optional[dict[str, Any]] = None,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        dual_clip: Optional[float] = None,
        seq_mask_tau: Optional[float] = None,
        policy_loss: str = "ppo_clip",
        advantages: str = "grpo",
        filter_groups: Optional[dict[str, Any]] = None,
        overlong_cache_len: int = 0,
        overlong_penalty_factor: float = 1.0,
        rollout_correction: Optional[dict[str, Any]] = None,
        loss_aggregation: str = "seq-mean-token-mean",
        scale_adv_by_std: bool = True,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_k3_cap: Optional[float] = None,
        entropy_coef: float = 0.0,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        micro_batch_size: int = 64,
        micro_batch_tokens: Optional[int] = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 24,
        ignore_eos: bool = False,
        chat_template: bool = False,
        eval_samples: int = 1,
        eval_temperature: float = 0.0,
        max_bad_steps: int = 5,
        seed: int = 0,
        perf_options: Optional[dict[str, Any]] = None,
        compile_update: bool = False,
        env: Optional[str] = None,
        env_options: Optional[dict[str, Any]] = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        hp = self.hparams  # (transitional: the typed settings, until the constructor takes them)
        given = {f.name: hp[f.name] for f in fields(AlgorithmConfig) if f.name in hp}
        given["filter_groups"] = SettingsFilterGroups(**(hp.filter_groups or {}))
        given["rollout_correction"] = dict(hp.rollout_correction or {})
        self.algorithm = AlgorithmConfig(**given)
        self.flops = StepFlops(**(perf_options or {}))  # perf/*: model FLOPs and MFU of each step
        self._check_options()
        self.environment = build_environment(env, env_options, reward=reward, reward_options=reward_options)
        path = resolve_model_path(model, model_options)
        self.policy, self.tokenizer = load_policy(path, dtype)
        self.context = model_context(self.policy, self.tokenizer)  # the positions every rollout must fit
        env_tokens = self.environment.max_tokens if self.environment is not None else None
        check_bounds(self.context, max_new_tokens=max_new_tokens, env_max_tokens=env_tokens)  # before any work
        self.response_budget = response_budget(max_new_tokens, env_tokens)  # (tokens, key): the data check's
        self.policy = apply_lora(self.policy, self.lora, seed=seed)  # only the adapters require grad
        self.policy.train()  # from_pretrained returns eval mode; Lightning toggles modes itself from here
        self.model_path = path
        copies = kl_coef > 0 and not self.lora.enabled  # LoRA's KL reference: the base itself (no second copy)
        self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval() if copies else None
        self.reward_runner = build_reward_runner(reward, reward_options)
        self.sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k,
                                       max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                                       eval_temperature=eval_temperature,
                                       stop_token_ids=stop_token_ids(self.policy, self.tokenizer.eos_token_id))
        # built in setup(): after the strategy has placed (and maybe sharded) the policy
        self.engine: Optional[Any] = None
        self.driver: Optional[RolloutDriver] = None
        self.val_metrics = ValidationMetrics(eval_samples)
        self.counters = {"rollouts_total": 0, "tokens_generated": 0, "skipped_steps": 0, "bad_steps_in_row": 0,
                         "reward_failures": 0, "rl_steps": 0}
        self.timer = StepTimer()
        self.step_metrics: dict[str, Tensor] = {}
        self._mask_counts: Optional[Tensor] = None  # during `update`: [counted, kept] loss tokens
        self._compiled: dict[str, nn.Module] = {}  # a dict: the compiled wrapper must not register as a submodule
        # the loss's metrics that average over sequences rather than tokens (GSPO's clip fraction)
        per_sequence = F.SEQUENCE_METRICS[policy_loss]
        self.token_metrics = self.token_metrics - per_sequence
        self.sequence_metrics = self.sequence_metrics | per_sequence
        enable = self.filter_groups.enable  # DAPO's dynamic sampling
        self.group_filter = GroupFilter(self.filter_groups, self.tokenizer.pad_token_id) if enable else None
        self._data_iter: Optional[Iterator] = None  # during a step that reads further batches (the group filter)
        if self.group_filter is not None:
            # Lightning hands a step the data iterator only when `training_step` takes `dataloader_iter`, and then
            # skips its batch hooks: only a run whose collector reads further batches is switched to it
            self.training_step = self._training_step_reading_batches

    def _check_options(self) -> None:
        """The table of ranges that train.py checks too (lit_rlvr.config.options), before the model loads."""
        hp = self.hparams
        nested = {key: finite_problems(hp.get(name), key) for name, key in NESTED_OPTIONS.items()}
        problems = (range_problems(hp, "algorithm") + [p for lines in nested.values() for p in lines]
                    + consistency_problems(hp) + compile_problems(hp.compile_update, sharded=False)
                    + reward_problems(hp.reward, hp.reward_options))  # e.g. a reward server's URL, reached
        if problems:
            raise ConfigError(problems)
        self.lora = LoraOptions.from_any(hp.lora)
        problems = self.lora.model_problems(hp.model, hp.model_options)  # before the warm-up and the load
        if problems:
            raise ConfigError(problems)
        self.rollout_correction = RolloutCorrector.from_options(hp.rollout_correction, type(self), GRPOModule)
        self.filter_groups = FilterGroups.from_options(hp.filter_groups)
        check_optimizer_options(hp.optimizer, hp.optimizer_options, lr=hp.lr, grad_clip=hp.grad_clip,
                                weight_decay=hp.weight_decay, dtype=hp.dtype)

    # -- Lightning plumbing ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        check_rl_callbacks(self.rl_callbacks(), self.hparams)  # the Lightning CLI and Python reach this first
        if self.hparams.compile_update:  # (setup may run without a trainer: tests, notebooks)
            problems = compile_problems(True, sharded=hasattr(self.trainer.strategy, "parallelize"))
            if problems:
                raise ConfigError(problems)
        if self.engine is None:
            options = dict(self.hparams.engine_options or {})
            with config_phase():  # the engine's option checks are config errors (one line from every entry)
                sync_check = SyncCheck.take_from(options)  # the driver's post-push check, not the engine's option
                self.engine = build_engine(self.hparams.engine, self.policy, self.tokenizer, options)
                problems = merged_push_problems(self.engine, self.policy)  # before any rollout
                if problems:
                    raise ConfigError(problems)
            self.driver = RolloutDriver(self.engine, self.tokenizer, self.reward_runner, self.sampling, self.policy,
                                        sync_check, environment=self.environment,
                                        chat_template=self.hparams.chat_template)

    def configure_model(self) -> None:
        """Lightning's parallelism hook: a sharding strategy (`FSDP2Strategy.parallelize`) shards here."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self)

    def on_fit_start(self) -> None:
        self._engine_to_device()
        self.flops.setup(self.policy, self.device, self.trainer, self.engine)

    def configure_callbacks(self) -> list[pl.Callback]:
        # with LoRA, every checkpoint save writes the adapter beside it, from every entry point
        return [FreezeSetupObjects(), *([AdapterExport()] if self.lora.enabled else [])]

    def on_validation_start(self) -> None:
        self._engine_to_device()

    def _engine_to_device(self) -> None:
        """A `copy` engine was built before the strategy placed the policy: put it on the trainer's device."""
        if self.engine is not None:
            self.engine.to(self.device)

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self.engine is not None:
            self.engine.sleep()

    def configure_optimizers(self):
        hp, trainer = self.hparams, self._trainer  # None when called outside a fit (tests, notebooks)
        with config_phase():  # the optimizer's own checks (torch: "Invalid learning rate") are config errors
            optimizer = build_optimizer(hp.optimizer, trainable_parameters(self.policy),
                                        lr=self.lora.learning_rate(hp.lr), betas=hp.betas,
                                        weight_decay=hp.weight_decay, options=hp.optimizer_options, seed=hp.seed,
                                        rank=self.global_rank, world_size=trainer.world_size if trainer else 1,
                                        strategy=type(trainer.strategy).__name__ if trainer else "none")
        factor = functools.partial(warmup_factor, warmup_steps=hp.warmup_steps, from_zero=hp.warmup_from_zero)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def rl_callbacks(self) -> list[RLVRCallback]:
        trainer = self._trainer
        return [cb for cb in (trainer.callbacks if trainer else []) if isinstance(cb, RLVRCallback)]

    def call_rl_hooks(self, hook: str, *args: Any) -> None:
        """`hook(trainer, module, *args)` on every `RLVRCallback`, in the trainer's order."""
        for cb in self.rl_callbacks():
            getattr(cb, hook)(self.trainer, self, *args)

    # -- one RL step -----------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int):
        self.timer.reset()
        self.flops.reset()
        self.step_metrics = {}
        self.step_rollouts_start = self.counters["rollouts_total"]
        rollouts = self.collect(batch)  # plan → callbacks edit it → generate and score (→ filter, refill)
        self.engine.sleep()  # SGLang frees its KV cache and weights while the trainer needs the memory
        self.call_rl_hooks("on_before_advantages", rollouts)  # V0.5: the fused baselines
        rollouts.advantages, adv_metrics = self.compute_advantages(rollouts)
        self.log_metrics(adv_metrics)
        with self.timer("train_s"):
            self.update(rollouts)
        self.sync_engine()
        self.call_rl_hooks("on_rl_step_end", rollouts)
        self._log_step(rollouts, self.timer.elapsed())
        self.counters["rl_steps"] += 1
        return None

    def _training_step_reading_batches(self, dataloader_iter: Iterator) -> None:
        """`training_step` of a run whose collector reads further batches of the data stream within the step."""
        batch, batch_idx, _ = next(dataloader_iter)
        self._note_batch()
        self._data_iter = dataloader_iter
        try:
            return type(self).training_step(self, batch, batch_idx)
        finally:
            self._data_iter = None

    def collect(self, batch: dict[str, list]) -> Rollouts:
        """The step's rollouts: the batch's (`collect_rollouts`), or with `filter_groups` the groups whose metric
        differs, refilled from the next batches (`GroupFilter`)."""
        if self.group_filter is None:
            return self.collect_rollouts(batch)
        try:
            rollouts, metrics = self.group_filter.collect(batch, self.collect_rollouts, self._next_batch)
        except GenerationBudgetError as err:  # what the run keeps, and that the cap may change on resume
            raise GenerationBudgetError([f"{err.problems[0]}; {checkpoint_hint(self._trainer)} (the cap may change "
                                         "on resume)"]) from err
        self.log_metrics(metrics)
        return rollouts

    def _next_batch(self) -> Optional[dict[str, list]]:
        """The data stream's next batch within this step, or None when it ran out (or outside `fit`)."""
        if self._data_iter is None:
            return None
        try:
            batch, _, _ = next(self._data_iter)
        except StopIteration:
            return None
        self._note_batch()
        return batch

    def _note_batch(self) -> None:
        """Tell the datamodule a batch was used: it keeps the data position that a resume continues from
        (Lightning skips its batch hooks when the step reads the iterator itself)."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if hasattr(datamodule, "note_batches"):
            datamodule.note_batches(1)

    def collect_rollouts(self, batch: dict[str, list], seed_stream: tuple[int, ...] = ()) -> Rollouts:
        """Plan the batch, let the callbacks edit the plan, generate and score. `seed_stream`: appended to the seed
        keys of the plan's engine calls, so each batch of a step that draws several (the group filter's refills)
        samples from its own stream; () for the step's first."""
        plan = self.make_plan(batch, seed_stream)
        self.call_rl_hooks("on_rollout_plan", plan)
        return self.rollout(plan)

    def make_plan(self, batch: dict[str, list], seed_stream: tuple[int, ...] = ()) -> RolloutPlan:
        prompts = [self.render_prompt(p) for p in batch["prompt"]]
        token_ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
        return RolloutPlan(prompts, list(batch["answer"]), token_ids, [self.hparams.group_size] * len(prompts),
                           seed_stream=seed_stream)

    def render_prompt(self, prompt: Any) -> str:
        if isinstance(prompt, str) and not self.hparams.chat_template:
            return prompt

        return render_prompt(prompt, self.tokenizer, chat_template=self.hparams.chat_template)

    def rollout(self, plan: RolloutPlan) -> Rollouts:
        """The plan's samples, generated and scored (`RolloutDriver.rollout`); counted into the run's totals."""
        with self._engine_hint():
            result = self.driver.rollout(plan, step=self.global_step, seed_key=self.seed_key())
        for phase, seconds in result.seconds.items():
            self.timer.add(phase, seconds)
        self.log_metrics(result.metrics)
        self.counters["rollouts_total"] += result.num_rollouts
        self.counters["tokens_generated"] += result.num_tokens
        self.counters["reward_failures"] += result.reward_failures
        if result.stop_reason:  # a hung reward call is left running: finish the step, save, stop
            self.trainer.should_stop = True
        self.flops.add_generation(result.rollouts)
        return result.rollouts

    def seed_key(self) -> tuple[int, int]:
        """(run seed, step): the key of this step's sampling seeds; the driver appends the round, the weight source
        and the plan's stream, so every engine call of a run draws from its own seed."""
        return (self.hparams.seed, self.global_step)

    @contextmanager
    def _engine_hint(self) -> Iterator[None]:
        """An engine failure names the engine and says what survives and what to do."""
        try:
            yield
        except EngineError as err:  # the same class (e.g. EngineSyncError), with the engine's name and the hint
            raise type(err)(f"engine {self.hparams.engine!r}: {err}; {checkpoint_hint(self._trainer)}") from err

    def sync_engine(self) -> None:
        """After the optimizer step: the engine must hold the new mean weights (version = global step)."""
        pushed = self.driver.push(step=self.global_step)
        self.timer.add("sync_s", pushed.seconds)
        self.log_metrics(pushed.metrics)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # after the callbacks' hook: RunCheckpoint has saved this step (the driver set should_stop)
        reason = self.reward_runner.stop_reason
        if reason:
            raise RewardHangError(f"{reason}; {checkpoint_hint(self._trainer)}")

    # -- advantages and loss (subclass points) ----------------------------------------------------------------
    def compute_advantages(self, rollouts: Rollouts) -> tuple[Tensor, dict[str, Tensor]]:
        """[N] advantages of `algorithm.advantages` (`functional.ADVANTAGES`); relative to `rollouts.baseline` when
        a callback set one (V0.5). With `overlong_cache_len` > 0, of the reward plus DAPO's overlong penalty
        (Yu et al. 2025, Eq. 13: `functional.overlong_penalty` over the last `overlong_cache_len` tokens of the
        budget, scaled by `overlong_penalty_factor`); `rollouts.rewards` stays the task reward, so `reward/accuracy`
        keeps its meaning. With an environment the budget is the rollout's, `env.max_tokens`, over its whole
        response (turns and observations), not one turn's `max_new_tokens`."""
        hp = self.hparams
        metrics: dict[str, Tensor] = {}
        if hp.overlong_cache_len > 0:
            if self.environment is None:
                lengths, max_len = rollouts.response_mask.sum(-1), hp.max_new_tokens  # [N]
            else:
                lengths, max_len = rollouts.response_attention_mask.sum(-1), self.environment.max_tokens  # [N]
            penalty, metrics = F.overlong_penalty(lengths, max_len=max_len, cache_len=hp.overlong_cache_len,
                                                  factor=hp.overlong_penalty_factor)
            rollouts = replace(rollouts, rewards=rollouts.rewards + penalty)  # [N]; a view of the batch, no copy
            metrics["reward/shaped_mean"] = rollouts.rewards.mean()
        group, num_groups = rollouts.advantage_groups()  # the prompts, or smaller groups set by a callback (M3PO)
        adv, adv_metrics = F.ADVANTAGES[hp.advantages](rollouts.rewards, group, num_groups,
                                                       scale_by_std=hp.scale_adv_by_std, baseline=rollouts.baseline)
        return adv, {**metrics, **adv_metrics}

    def policy_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    rollouts: Rollouts) -> tuple[Tensor, dict[str, Tensor]]:
        """Surrogate loss of one micro-batch, `algorithm.policy_loss` of `functional.POLICY_LOSSES`, with the
        rollout correction's token weights. logp, old_logp, mask: [n, T]; advantages: [n]."""
        hp = self.hparams
        return F.POLICY_LOSSES[hp.policy_loss](logp, old_logp, advantages, mask, eps_low=hp.eps_low,
                                               eps_high=hp.eps_high, aggregation=hp.loss_aggregation,
                                               norm_len=hp.max_new_tokens, dual_clip=hp.dual_clip,
                                               token_weights=getattr(rollouts, "token_weights", None))

    # -- the update -------------------------------------------------------------------------------------------
    def update(self, rollouts: Rollouts) -> None:
        """The step's optimizer steps (`lit_rlvr.update.Update`); its metrics go to this step's row."""
        try:
            self.log_metrics(self.make_update().run(rollouts, step=self.global_step))
        except NonFiniteError as err:  # the same error, saying what the run keeps
            raise NonFiniteError(f"{err}; {checkpoint_hint(self._trainer)}") from None

    def make_update(self, optimizer: Optional[Any] = None) -> Update:
        """The update, built from the module's parts as they are now: `algorithm`'s loss, update and optimizer
        settings, the fit's optimizer and lr schedule, the callbacks' loss contexts. Cheap, so built for every step:
        a `module.algorithm` replaced between steps takes effect at the next one. Without a trainer (tests,
        notebooks): `optimizer` (None: loss passes only), plain autograd, no callbacks."""
        fitting, algorithm = self._trainer is not None, self.algorithm
        contexts = [functools.partial(cb.loss_context, self.trainer, self) for cb in self.rl_callbacks()]
        return Update(self.policy, self.optimizers() if fitting else optimizer,
                      self.lr_schedulers() if fitting else None, loss=algorithm.loss, update=algorithm.update,
                      grad_clip=algorithm.grad_clip, temperature=algorithm.temperature,
                      norm_len=algorithm.max_new_tokens, policy_loss=self.policy_loss,
                      correction=self.rollout_correction, ref_policy=self.ref_policy, loss_contexts=contexts,
                      backward=self.manual_backward if fitting else None, model=self.update_policy(),
                      counters=self.counters, timer=self.timer, device=self.device,
                      token_metrics=self.token_metrics, sequence_metrics=self.sequence_metrics)

    def update_policy(self) -> nn.Module:
        """The policy as the update's loss runs it: compiled with `compile_update` (dynamic shapes: micro-batches
        of any size and width reuse one graph), itself otherwise. Same parameters either way."""
        if not self.hparams.compile_update:
            return self.policy
        if "policy" not in self._compiled:
            self._compiled["policy"] = torch.compile(self.policy, dynamic=True)
        return self._compiled["policy"]

    # -- metrics ----------------------------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, Tensor]) -> None:
        """Add metrics to this step's row (callbacks call this too)."""
        self.step_metrics.update({k: v.detach().float() if isinstance(v, Tensor) else torch.tensor(float(v))
                                  for k, v in metrics.items()})

    def _log_step(self, rollouts: Rollouts, step_s: float) -> None:
        lengths = rollouts.response_mask.sum(-1).float()  # [N]
        metrics = {
            "reward/mean": rollouts.rewards.mean(),
            "reward/accuracy": (rollouts.rewards > 0).float().mean(),
            "reward/malformed_frac": rollouts.malformed.float().mean(),
            "response/len_mean": lengths.mean(),
            "response/len_max": lengths.max(),
            "response/clip_frac": torch.tensor([r == "length" for r in rollouts.finish_reason]).float().mean(),
            # generated this step (more than the trained batch when a subclass drops groups)
            "rollouts/per_step": torch.tensor(float(self.counters["rollouts_total"] - self.step_rollouts_start)),
            "rollouts/total": torch.tensor(float(self.counters["rollouts_total"])),
            "train/skipped_steps": torch.tensor(float(self.counters["skipped_steps"])),
            "perf/tokens_per_s": torch.tensor(rollouts.num_tokens() / max(step_s, 1e-9)),
            "time/step_s": torch.tensor(step_s),
            **{f"time/{k}": torch.tensor(v) for k, v in self.timer.times.items()},
            **self.flops.metrics(rollouts, self.timer.times, passes=self.hparams.ppo_epochs,
                                 reference=self.ref_policy is not None,
                                 recompute=recomputes_forward(self.policy),
                                 old_forward=not self.rollout_correction.options.bypass),
            **env_metrics(rollouts),  # multi-turn only: env/turns_mean, env/tool_calls_mean, ...
        }
        self.log_metrics(metrics)
        self.step_metrics = D.reduce_metrics(self.step_metrics)  # the global batch's figures, on every rank
        write_step_metrics(self.trainer, self.step_metrics, progress_bar=("reward/mean", "reward/accuracy"))

    # -- evaluation --------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        if self.engine is None:
            self.setup("validate")
        with self._engine_hint():  # the engine keys its seed per prompt: every evaluation draws the same samples
            correct = self.driver.evaluate(self.make_plan(batch), self.hparams.eval_samples, step=self.global_step,
                                           seed=seed_of("eval", self.hparams.seed))  # [B, n]
        self.val_metrics.update(correct)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute(), on_epoch=True, prog_bar=True)
        self.val_metrics.reset()
        if self.trainer.state.fn == "fit":  # a row logged inside fit carries the step before the policy's: say which
            counters = self.global_counters()
            self.log_dict({"val/rl_steps": float(counters["rl_steps"]),
                           "val/rollouts_total": float(counters["rollouts_total"])}, on_epoch=True)

    SUMMED_COUNTERS = ("rollouts_total", "tokens_generated", "reward_failures")  # per rank; the run's is the sum

    def global_counters(self) -> dict[str, int]:
        """The run's counters summed over data-parallel ranks (a collective: call it on every rank)."""
        values = D.all_reduce(torch.tensor([self.counters[k] for k in self.SUMMED_COUNTERS], dtype=torch.long))
        return {**self.counters, **dict(zip(self.SUMMED_COUNTERS, values.tolist()))}

    # -- state -------------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the run's totals (every rank saves, one file is written): a resume gives them to rank 0, 0 to the others
        checkpoint["lit_rlvr"] = {"counters": self.global_counters(), "engine_version": self.global_step,
                                  "model_path": self.model_path, "rng": rng_states()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("lit_rlvr", {})
        self.counters.update(state.get("counters", {}))
        if self.global_rank != 0:
            self.counters.update(dict.fromkeys(self.SUMMED_COUNTERS, 0))
        if "rng" in state:  # a resumed run draws the random numbers the uninterrupted run would have drawn
            set_rng_states(state["rng"])
        if self.driver is not None:  # the engine must receive the restored weights before the next rollout
            self.driver.weight_sync.forget()
