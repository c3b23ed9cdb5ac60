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
from dataclasses import replace
from typing import Any, Callable, ContextManager, Iterator, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lit_rlvr import functional as F
from lit_rlvr.algorithms.filter_groups import DataStream, GroupFilter
from lit_rlvr.config.bounds import check_bounds, model_context, response_budget
from lit_rlvr.config.arguments import module_settings
from lit_rlvr.config.errors import ConfigError, GenerationBudgetError, NonFiniteError, RewardHangError
from lit_rlvr.config.settings import (AlgorithmConfig, EngineConfig, EnvConfig, FilterGroups, LoraOptions,
                                      ModelConfig, PerfConfig, RewardConfig)
from lit_rlvr.config.options import compile_problems
from lit_rlvr.data.formats import render_prompt
from lit_rlvr.envs import build_environment, env_options
from lit_rlvr.hooks import RLVRCallback, check_rl_callbacks
from lit_rlvr.models.lora import apply_lora, model_problems, trainable_parameters
from lit_rlvr.models.warmup import load_model
from lit_rlvr.optim.build import build_optimizer, check_optimizer_options
from lit_rlvr.optim.schedule import warmup_factor
from lit_rlvr.rewards import build_reward_runner, reward_problems
from lit_rlvr.rollout.batch import RolloutPlan, Rollouts
from lit_rlvr.rollout.driver import RolloutDriver, stop_token_ids
from lit_rlvr.rollout.engine import SamplingConfig, engine_hint
from lit_rlvr.rollout.multi_turn import env_metrics
from lit_rlvr.run import distributed as D
from lit_rlvr.run.adapter_export import AdapterExport
from lit_rlvr.run.checkpoint_io import checkpoint_hint
from lit_rlvr.run.counters import RunCounters
from lit_rlvr.run.freeze import FreezeSetupObjects
from lit_rlvr.run.one_line import config_phase
from lit_rlvr.run.perf import StepFlops, recomputes_forward
from lit_rlvr.run.rng import rng_states, seed_of, set_rng_states
from lit_rlvr.run.step_log import StepTimer, step_row, write_step_metrics
from lit_rlvr.run.validation import ValidationMetrics
from lit_rlvr.update import SEQUENCE_METRICS, TOKEN_METRICS, RolloutCorrector, Update

log = logging.getLogger(__name__)


class GRPOModule(pl.LightningModule):
    """GRPO with PPO-clip (Shao et al. 2024) and the usual knobs; docs/architecture.md §4 has the equations.

    Settings (lit_rlvr.config.settings), one typed object per config group, each given as the object, a mapping of
    its fields, or its shorthand: `model` a `ModelConfig`, an HF path or hub name, "tiny" (the built-in model), or an
    `nn.Module` with its `tokenizer`; `algorithm` an `AlgorithmConfig` (loss, advantages, update, optimizer,
    sampling; verl's `rollout_correction` and `filter_groups`); `reward` a `RewardConfig`, a built-in name,
    "package.module:function" or the callable `fn(prompt, completion, answer) -> score`; `engine` (hf, sglang,
    vllm); `env` (multi-turn environments, docs/environments.md); `perf` (the peak FLOP/s of `perf/mfu_*`);
    `seed`. A notebook may give any setting as a flat keyword instead (`lr=1e-4`, `group_size=4`,
    `model_options={...}`: `lit_rlvr.config.arguments.SHORTCUTS`).
    """

    # loss metrics that are means over response tokens, and over sequences (a subclass may move one)
    token_metrics, sequence_metrics = TOKEN_METRICS, SEQUENCE_METRICS

    def __init__(self, model: Union[ModelConfig, str, nn.Module] = ModelConfig(),
                 algorithm: AlgorithmConfig = AlgorithmConfig(),
                 reward: Union[RewardConfig, str, Callable[..., Any]] = RewardConfig(),
                 engine: Union[EngineConfig, str] = EngineConfig(), env: Union[EnvConfig, str, None] = EnvConfig(),
                 perf: PerfConfig = PerfConfig(), seed: int = 0, tokenizer: Any = None, **shortcuts: Any):
        super().__init__()
        self.automatic_optimization = False
        with config_phase():  # unknown keys, types and ranges: one line each, before the model loads
            self.settings = module_settings(model, algorithm, reward, engine, env, perf, seed, shortcuts)
        # Lightning's copy, for `load_from_checkpoint` and the loggers (nested plain values: the CLI's keys)
        self.save_hyperparameters(self.settings.as_dict())
        self.lora, self.rollout_correction, self.filter_groups = self._check_settings()
        cfg, algo = self.settings, self.settings.algorithm
        self.flops = StepFlops(cfg.perf.peak_flops, cfg.perf.cache_dir)  # perf/*: model FLOPs and MFU of each step
        env_name = None if cfg.env.name == "none" else cfg.env.name
        self.environment = build_environment(env_name, env_options(cfg.env), reward=cfg.reward.name,
                                             reward_options=cfg.reward.options)
        self.policy, self.tokenizer, self.model_path = load_model(model, tokenizer, cfg.model)
        self.context = model_context(self.policy, self.tokenizer)  # the positions every rollout must fit
        env_tokens = self.environment.max_tokens if self.environment is not None else None
        check_bounds(self.context, max_new_tokens=algo.max_new_tokens, env_max_tokens=env_tokens)  # before any work
        self.response_budget = response_budget(algo.max_new_tokens, env_tokens)  # (tokens, key): the data check's
        self.policy = apply_lora(self.policy, self.lora, seed=seed)  # only the adapters require grad
        self.policy.train()  # from_pretrained returns eval mode; Lightning toggles modes itself from here
        copies = algo.kl_coef > 0 and not self.lora.enabled  # LoRA's KL reference: the base itself (no second copy)
        self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval() if copies else None
        self.reward_runner = build_reward_runner(cfg.reward.name, cfg.reward.options)
        self.sampling = SamplingConfig.of(algo, stop_token_ids(self.policy, self.tokenizer.eos_token_id))
        # built in setup(): after the strategy has placed (and maybe sharded) the policy
        self.engine: Optional[Any] = None
        self.driver: Optional[RolloutDriver] = None
        self.val_metrics = ValidationMetrics(algo.eval_samples)
        self.counters = RunCounters()
        self.timer = StepTimer()
        self.step_metrics: dict[str, Tensor] = {}
        self._compiled: dict[str, nn.Module] = {}  # a dict: the compiled wrapper must not register as a submodule
        # the loss's metrics that average over sequences rather than tokens (GSPO's clip fraction)
        per_sequence = F.SEQUENCE_METRICS[algo.policy_loss]
        self.token_metrics = self.token_metrics - per_sequence
        self.sequence_metrics = self.sequence_metrics | per_sequence
        enable = self.filter_groups.enable  # DAPO's dynamic sampling
        self.group_filter = GroupFilter(self.filter_groups, self.tokenizer.pad_token_id) if enable else None
        self._data_stream = DataStream(None)  # a step's, when its collector reads further batches (DataStream)
        if self.group_filter is not None:  # only such a run asks Lightning for the iterator (it skips batch hooks)
            self.training_step = self._training_step_reading_batches

    @property
    def algorithm(self) -> AlgorithmConfig:
        return self.settings.algorithm

    @algorithm.setter
    def algorithm(self, value: AlgorithmConfig) -> None:  # tests and benchmarks vary one setting of a built module
        self.settings = replace(self.settings, algorithm=value)
        self.hparams["algorithm"] = self.settings.as_dict()["algorithm"]  # what a checkpoint records

    def _check_settings(self) -> tuple[LoraOptions, RolloutCorrector, FilterGroups]:
        """The settings' own rules (`ModuleSettings.problems`), the reward's, LoRA's on this model and the
        optimizer's, before the model loads."""
        cfg, algo = self.settings, self.settings.algorithm
        problems = cfg.problems() + reward_problems(cfg.reward.name, cfg.reward.options)  # e.g. a server, reached
        if problems:
            raise ConfigError(problems)
        lora = cfg.model.lora
        problems = model_problems(lora, cfg.model.name_or_path, cfg.model.options)  # before the warm-up and the load
        if problems:
            raise ConfigError(problems)
        check_optimizer_options(algo.optimizer, algo.optimizer_options, lr=algo.lr, grad_clip=algo.grad_clip,
                                weight_decay=algo.weight_decay, dtype=cfg.model.dtype)
        return (lora, RolloutCorrector.from_options(algo.rollout_correction, type(self), GRPOModule),
                algo.filter_groups)

    # -- Lightning plumbing ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        check_rl_callbacks(self.rl_callbacks(), self.algorithm)  # the Lightning CLI and Python reach this first
        if self.settings.model.compile:  # (setup may run without a trainer: tests, notebooks)
            problems = compile_problems(True, sharded=hasattr(self.trainer.strategy, "parallelize"))
            if problems:
                raise ConfigError(problems)
        if self.engine is None:
            with config_phase():  # the engine's option checks are config errors (one line from every entry)
                self.driver = RolloutDriver.build(self.settings.engine.name, self.settings.engine.options,
                                                  self.policy, self.tokenizer, self.reward_runner, self.sampling,
                                                  environment=self.environment,
                                                  chat_template=self.settings.model.chat_template)
            self.engine = self.driver.engine

    def configure_model(self) -> None:
        """Lightning's parallelism hook: a sharding strategy (`FSDP2Strategy.parallelize`) shards here."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None) if self._trainer is not None else None
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
        hp, trainer = self.algorithm, self._trainer  # None when called outside a fit (tests, notebooks)
        with config_phase():  # the optimizer's own checks (torch: "Invalid learning rate") are config errors
            optimizer = build_optimizer(hp.optimizer, trainable_parameters(self.policy),
                                        lr=self.lora.learning_rate(hp.lr), betas=hp.betas, weight_decay=hp.weight_decay,
                                        options=hp.optimizer_options, seed=self.settings.seed,
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
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        self._data_stream = DataStream(dataloader_iter, datamodule)
        try:
            return type(self).training_step(self, *self._data_stream.first())
        finally:
            self._data_stream = DataStream(None)

    def collect(self, batch: dict[str, list]) -> Rollouts:
        """The step's rollouts: the batch's (`collect_rollouts`), or with `filter_groups` the groups whose metric
        differs, refilled from the next batches (`GroupFilter`)."""
        if self.group_filter is None:
            return self.collect_rollouts(batch)
        try:
            rollouts, metrics = self.group_filter.collect(batch, self.collect_rollouts, self._data_stream.next_batch)
        except GenerationBudgetError as err:  # what the run keeps, and that the cap may change on resume
            raise GenerationBudgetError([f"{err.problems[0]}; {checkpoint_hint(self._trainer)} (the cap may change "
                                         "on resume)"]) from err
        self.log_metrics(metrics)
        return rollouts

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
        return RolloutPlan(prompts, list(batch["answer"]), token_ids, [self.algorithm.group_size] * len(prompts),
                           seed_stream=seed_stream)

    def render_prompt(self, prompt: Any) -> str:
        if isinstance(prompt, str) and not self.settings.model.chat_template:
            return prompt

        return render_prompt(prompt, self.tokenizer, chat_template=self.settings.model.chat_template)

    def rollout(self, plan: RolloutPlan) -> Rollouts:
        """The plan's samples, generated and scored (`RolloutDriver.rollout`); counted into the run's totals."""
        with self._engine_hint():
            result = self.driver.rollout(plan, step=self.global_step, seed_key=self.seed_key())
        result.count_into(self.counters, self.timer)
        self.log_metrics(result.metrics)
        if result.stop_reason:  # a hung reward call is left running: finish the step, save, stop
            self.trainer.should_stop = True
        self.flops.add_generation(result.rollouts)
        return result.rollouts

    def seed_key(self) -> tuple[int, int]:
        """(run seed, step): the key of this step's sampling seeds; the driver appends the round, the weight source
        and the plan's stream, so every engine call of a run draws from its own seed."""
        return (self.settings.seed, self.global_step)

    def _engine_hint(self) -> ContextManager[None]:
        """An engine failure names the engine and says what survives and what to do."""
        return engine_hint(self.settings.engine.name, functools.partial(checkpoint_hint, self._trainer))

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
        hp = self.algorithm
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
        hp = self.algorithm
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
        if not self.settings.model.compile:
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
        flops = self.flops.metrics(rollouts, self.timer.times, passes=self.algorithm.ppo_epochs,
                                   reference=self.ref_policy is not None, recompute=recomputes_forward(self.policy),
                                   old_forward=not self.rollout_correction.options.bypass)
        self.log_metrics(step_row(rollouts, self.counters, self.step_rollouts_start, self.timer, step_s,
                                  {**flops, **env_metrics(rollouts)}))  # env/*: multi-turn only
        self.step_metrics = D.reduce_metrics(self.step_metrics)  # the global batch's figures, on every rank
        write_step_metrics(self.trainer, self.step_metrics, progress_bar=("reward/mean", "reward/accuracy"))

    # -- evaluation --------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        if self.engine is None:
            self.setup("validate")
        with self._engine_hint():  # the engine keys its seed per prompt: every evaluation draws the same samples
            correct = self.driver.evaluate(self.make_plan(batch), self.algorithm.eval_samples, step=self.global_step,
                                           seed=seed_of("eval", self.settings.seed))  # [B, n]
        self.val_metrics.update(correct)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute(), on_epoch=True, prog_bar=True)
        self.val_metrics.reset()
        if self.trainer.state.fn == "fit":  # a row logged inside fit carries the step before the policy's: say which
            counters = self.counters.global_values()
            self.log_dict({"val/rl_steps": float(counters["rl_steps"]),
                           "val/rollouts_total": float(counters["rollouts_total"])}, on_epoch=True)

    # -- state -------------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the run's totals (every rank saves, one file is written): a resume gives them to rank 0, 0 to the others
        checkpoint["lit_rlvr"] = {"counters": self.counters.global_values(), "engine_version": self.global_step,
                                  "model_path": self.model_path, "rng": rng_states()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("lit_rlvr", {})
        self.counters.restore(state.get("counters", {}), self.global_rank)
        if "rng" in state:  # a resumed run draws the random numbers the uninterrupted run would have drawn
            set_rng_states(state["rng"])
        if self.driver is not None:  # the engine must receive the restored weights before the next rollout
            self.driver.weight_sync.forget()
