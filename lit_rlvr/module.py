"""`GRPOModule`: the LightningModule of one RL step (docs/architecture.md §3): plan → rollout and reward →
advantages → update → engine weight sync. Rollouts come from the run's `RolloutSource` (lit_rlvr.rollout.source:
sync or async generation, the pushes, the weights' version) through a per-step `StepCollector`; optimizer steps are
an `Update`'s (lit_rlvr.update). Subclass points: `compute_advantages`, `policy_loss`, `configure_optimizers`.
Methods that change the plan, the baseline or the weights the gradient is taken at are `RLVRCallback`s.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lit_rlvr import functional as F
from lit_rlvr.algorithms.filter_groups import DataStream, GroupFilter
from lit_rlvr.algorithms.prompt_history import history_parts
from lit_rlvr.config.bounds import check_bounds, model_context, response_budget
from lit_rlvr.config.arguments import module_settings
from lit_rlvr.config.errors import ConfigError, RewardHangError
from lit_rlvr.config.settings import (AlgorithmConfig, EngineConfig, EnvConfig, ModelConfig, PerfConfig,
                                      RewardConfig, RolloutConfig)
from lit_rlvr.config.options import compile_problems
from lit_rlvr.config.problems import secret_problems
from lit_rlvr.envs import build_environment, env_options, environment_spec
from lit_rlvr.hooks import RLVRCallback, check_rl_callbacks
from lit_rlvr.models.lora import apply_lora, model_problems, trainable_parameters
from lit_rlvr.rollout.warmup import load_model
from lit_rlvr.optim.build import check_optimizer_options, optimizer_and_schedule
from lit_rlvr.rewards import build_reward_runner, reward_problems
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.rollout.driver import RolloutDriver, stop_token_ids
from lit_rlvr.rollout.engine import SamplingConfig
from lit_rlvr.rollout.multi_turn import env_metrics
from lit_rlvr.rollout.source import RolloutSource, build_source, engine_options
from lit_rlvr.run import distributed as D
from lit_rlvr.models.adapter_export import AdapterExport
from lit_rlvr.run.checkpoint_io import checkpoint_hint
from lit_rlvr.run.close_pipeline import ClosePipeline
from lit_rlvr.run.counters import RunCounters
from lit_rlvr.run.freeze import FreezeSetupObjects
from lit_rlvr.run.one_line import config_phase
from lit_rlvr.run.perf import StepFlops, recomputes_forward
from lit_rlvr.run.rng import rng_states, seed_of, set_rng_states
from lit_rlvr.run.step_count import not_a_step
from lit_rlvr.run.step_log import step_row, write_step_metrics
from lit_rlvr.run.step_timer import StepTimer
from lit_rlvr.run.validation import ValidationMetrics
from lit_rlvr.update import SEQUENCE_METRICS, TOKEN_METRICS, RolloutCorrector, Update


class GRPOModule(pl.LightningModule):
    """GRPO with PPO-clip (Shao et al. 2024) and the usual knobs; docs/architecture.md §4 has the equations.

    Settings (lit_rlvr.config.settings): one typed object per config group (`model`, `algorithm`, `reward`,
    `engine`, `env`, `perf`, `rollout`) and the `seed`. Each may be given as the object, a mapping of its fields or its
    shorthand (`model="tiny"`, an HF path, or an `nn.Module` with its `tokenizer`; `reward` a built-in name,
    "package.module:function" or a callable), or, in a notebook, as flat keywords (`lr=1e-4`:
    `lit_rlvr.config.arguments.SHORTCUTS`).
    """

    # loss metrics that are means over response tokens, and over sequences (a subclass may move one)
    token_metrics, sequence_metrics = TOKEN_METRICS, SEQUENCE_METRICS

    def __init__(self, model: Union[ModelConfig, str, nn.Module] = ModelConfig(),
                 algorithm: AlgorithmConfig = AlgorithmConfig(),
                 reward: Union[RewardConfig, str, Callable[..., Any]] = RewardConfig(),
                 engine: Union[EngineConfig, str] = EngineConfig(), env: Union[EnvConfig, str, None] = EnvConfig(),
                 perf: PerfConfig = PerfConfig(), rollout: RolloutConfig = RolloutConfig(), seed: int = 0,
                 tokenizer: Any = None, **shortcuts: Any):
        super().__init__()
        self.automatic_optimization = False
        with config_phase():  # unknown keys, types and ranges: one line each, before the model loads
            self.settings = module_settings(model, algorithm, reward, engine, env, perf, seed, shortcuts, rollout)
        # Lightning's copy, for `load_from_checkpoint` and the loggers (nested plain values: the CLI's keys)
        self.save_hyperparameters(self.settings.as_dict())
        self._check_settings()
        cfg, algo = self.settings, self.settings.algorithm
        self.flops = StepFlops(cfg.perf.peak_flops, cfg.perf.cache_dir, cfg.perf.peak_bandwidth)  # perf/*: MFU, MBU
        environment_spec(cfg.env.name, env_options(cfg.env))  # checked before the model loads
        self.policy, self.tokenizer, self.model_path = load_model(model, tokenizer, cfg.model)
        self.context = model_context(self.policy, self.tokenizer)  # the positions every rollout must fit
        self.environment = build_environment(cfg.env.name, env_options(cfg.env), reward=cfg.reward.name,
                                             reward_options=cfg.reward.options, context=self.context)  # None: none
        env_tokens = self.environment.max_tokens if self.environment is not None else None
        check_bounds(self.context, max_new_tokens=algo.max_new_tokens, env_max_tokens=env_tokens)  # before any work
        self.response_budget = response_budget(algo.max_new_tokens, env_tokens)  # (tokens, key): the data check's
        self.policy = apply_lora(self.policy, cfg.model.lora, seed=seed)  # only the adapters require grad
        self.policy.train()  # from_pretrained returns eval mode; Lightning toggles modes itself from here
        copies = algo.kl_coef > 0 and not cfg.model.lora.enabled  # LoRA's KL reference: the base (no second copy)
        self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval() if copies else None
        self.reward_runner = build_reward_runner(cfg.reward.name, cfg.reward.options)
        self.sampling = SamplingConfig.of(algo, stop_token_ids(self.policy, self.tokenizer.eos_token_id))
        # built in setup(): after the strategy has placed (and maybe sharded) the policy
        self.engine: Optional[Any] = None
        self.driver: Optional[RolloutDriver] = None
        self.source: Optional[RolloutSource] = None
        self._restored: dict[str, Any] = {}  # a checkpoint's, for a source built after it was loaded
        self.val_metrics = ValidationMetrics(algo.eval_samples)
        self.counters, self.timer = RunCounters(), StepTimer()
        self.step_metrics: dict[str, Tensor] = {}
        self._compiled: dict[str, nn.Module] = {}  # a dict: the compiled wrapper must not register as a submodule
        self._data_stream = DataStream(None)  # a step's, when its collector reads further batches (DataStream)
        if algo.filter_groups.enable:  # only such a run asks Lightning for the iterator (it skips batch hooks)
            self.training_step = self._training_step_reading_batches

    @property
    def algorithm(self) -> AlgorithmConfig:
        return self.settings.algorithm

    @algorithm.setter
    def algorithm(self, value: AlgorithmConfig) -> None:  # tests and benchmarks vary one setting of a built module
        self.settings = replace(self.settings, algorithm=value)
        self.hparams["algorithm"] = self.settings.as_dict()["algorithm"]  # what a checkpoint records

    def _check_settings(self) -> None:
        """The settings' own rules (`ModuleSettings.problems`), the reward's, LoRA's on this model, the
        optimizer's and the correction's on this class, before the model loads."""
        cfg, algo = self.settings, self.settings.algorithm
        ConfigError.check(secret_problems(cfg.as_dict())  # first: before a request carries them or a file holds them
                          or cfg.problems() + reward_problems(cfg.reward.name, cfg.reward.options)  # reaches a server
                          or model_problems(cfg.model.lora, cfg.model.name_or_path, cfg.model.options))
        check_optimizer_options(algo.optimizer, algo.optimizer_options, lr=algo.lr, grad_clip=algo.grad_clip,
                                weight_decay=algo.weight_decay, dtype=cfg.model.dtype)
        algo.rollout_correction.check_loss_class(type(self), GRPOModule)

    # -- Lightning plumbing ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        rollout, engine = self.settings.rollout, self.settings.engine
        check_rl_callbacks(self.rl_callbacks(), self.algorithm, rollout, lora=self.settings.model.lora.enabled,
                           ranks=self.trainer.world_size if self._trainer is not None else 1)  # CLI, Python: first
        if self.settings.model.compile:  # (setup may run without a trainer: tests, notebooks)
            ConfigError.check(compile_problems(True, sharded=hasattr(self.trainer.strategy, "parallelize")))
        if self.engine is None:
            with config_phase():  # the engine's option checks are config errors (one line from every entry)
                self.driver = RolloutDriver.build(engine.name, engine_options(engine.name, engine.options, rollout),
                                                  self.policy, self.tokenizer, self.reward_runner, self.sampling,
                                                  environment=self.environment,
                                                  chat_template=self.settings.model.chat_template)
                self.source = build_source(self.driver, rollout, tokenizer=self.tokenizer, seed=self.settings.seed,
                                           chat_template=self.settings.model.chat_template, counters=self.counters,
                                           timer=self.timer, engine_name=engine.name, hint=self._checkpoint_hint)
            self.source.load_state_dict(self._restored)
            self.engine = self.driver.engine

    def configure_model(self) -> None:
        """Lightning's parallelism hook: a sharding strategy (`FSDP2Strategy.parallelize`) shards here."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None) if self._trainer is not None else None
        if parallelize is not None:
            parallelize(self)

    def on_fit_start(self) -> None:
        self.on_validation_start()  # the engine on the trainer's device
        self.flops.setup(self.policy, self.device, self.trainer, self.engine)

    def configure_callbacks(self) -> list[pl.Callback]:
        # with LoRA, every checkpoint save writes the adapter beside it; DBB and the boundary gate: the prompts' history
        return [FreezeSetupObjects(), ClosePipeline(), *history_parts(self.algorithm),
                *([AdapterExport()] if self.settings.model.lora.enabled else [])]

    def on_validation_start(self) -> None:
        """A `copy` engine was built before the strategy placed the policy: put it on the trainer's device."""
        if self.engine is not None:
            self.engine.to(self.device)

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self.source is not None:  # (when fit fails: `ClosePipeline` closes the source)
            self.source.close()
            self.engine.sleep()

    def configure_optimizers(self):
        trainer, algo = self._trainer, self.algorithm  # no trainer outside a fit (tests, notebooks)
        return optimizer_and_schedule(algo.optim, trainable_parameters(self.policy),
                                      lr=self.settings.model.lora.learning_rate(algo.lr), seed=self.settings.seed,
                                      rank=self.global_rank, world_size=trainer.world_size if trainer else 1,
                                      strategy=type(trainer.strategy).__name__ if trainer else "none")

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
        if rollouts is None:  # the source has no batch yet (async: the producer's first): no update, no row
            not_a_step(self.trainer)
            return None
        self.call_rl_hooks("on_before_advantages", rollouts)  # V0.5: the fused baselines
        rollouts.advantages, adv_metrics = self.compute_advantages(rollouts)
        self.log_metrics(adv_metrics)
        with self.timer("train_s"):
            self.update(rollouts)
        self.log_metrics(self.source.push())  # the engine takes the new weights: the next version
        self.call_rl_hooks("on_rl_step_end", rollouts)
        self._log_step(rollouts, self.timer.elapsed())
        return None

    def _training_step_reading_batches(self, dataloader_iter: Iterator) -> None:
        """`training_step` of a run whose collector reads further batches of the data stream within the step."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        self._data_stream = DataStream(dataloader_iter, datamodule)
        try:
            return type(self).training_step(self, *self._data_stream.first())
        finally:
            self._data_stream = DataStream(None)

    def collect(self, batch: dict[str, list]) -> Optional[Rollouts]:
        """The step's rollouts from the source, collected with the module's parts as they are now (None: none yet)."""
        algo, trainer = self.algorithm, self._trainer
        collected = self.source.collect(
            batch, step=self.global_step, group_size=algo.group_size, flops=self.flops,
            plan_hooks=[functools.partial(cb.on_rollout_plan, trainer, self) for cb in self.rl_callbacks()],
            group_filter=GroupFilter(algo.filter_groups, self.tokenizer.pad_token_id) if algo.filter_groups.enable
            else None, next_batch=self._data_stream.next_batch)
        if collected is None:
            return None
        rollouts, metrics, stop_reason = collected
        self.log_metrics(metrics)
        if stop_reason:  # a hung reward call is left running: finish the step, save, stop
            self.trainer.should_stop = True
        return rollouts

    def seed_key(self) -> tuple[int, int]:
        """(run seed, step): this step's seed key; the driver adds the round, weight source and plan's stream."""
        return (self.settings.seed, self.global_step)

    def _checkpoint_hint(self) -> str:
        """What the run keeps if it fails now (its last checkpoint) and what to do."""
        return checkpoint_hint(self._trainer)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # after the callbacks' hook: RunCheckpoint has saved this step (the driver set should_stop)
        if self.reward_runner.stop_reason:
            raise RewardHangError(f"{self.reward_runner.stop_reason}; {self._checkpoint_hint()}")

    # -- advantages and loss (subclass points) ----------------------------------------------------------------
    def compute_advantages(self, rollouts: Rollouts) -> tuple[Tensor, dict[str, Tensor]]:
        """[N] advantages of `algorithm.advantages` (`functional.ADVANTAGES`), relative to `rollouts.baseline` when a
        callback set one (V0.5, DBB), 0 for prompts a callback gated (`rollouts.update_groups`), of the reward plus
        DAPO's overlong penalty (`functional.overlong_penalty`, Eq. 13; with an environment, over `env.max_tokens`)."""
        hp, metrics = self.algorithm, {}
        if hp.overlong_cache_len > 0:
            lengths, max_len = ((rollouts.response_mask.sum(-1), hp.max_new_tokens) if self.environment is None
                                else (rollouts.response_attention_mask.sum(-1), self.environment.max_tokens))  # [N]
            penalty, metrics = F.overlong_penalty(lengths, max_len=max_len, cache_len=hp.overlong_cache_len,
                                                  factor=hp.overlong_penalty_factor)
            rollouts = replace(rollouts, rewards=rollouts.rewards + penalty)  # [N]; a view of the batch, no copy
            metrics["reward/shaped_mean"] = rollouts.rewards.mean()
        group, num_groups = rollouts.advantage_groups()  # the prompts, or smaller groups set by a callback (M3PO)
        adv, adv_metrics = F.ADVANTAGES[hp.advantages](rollouts.rewards, group, num_groups,
                                                       scale_by_std=hp.scale_adv_by_std, baseline=rollouts.baseline)
        gate = rollouts.update_groups  # [B] bool or None (boundary gating: a solved prompt gives no gradient)
        return adv if gate is None else adv * gate[rollouts.group].to(adv.dtype), {**metrics, **adv_metrics}

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
        self.log_metrics(self.make_update().run(rollouts, step=self.global_step))

    def make_update(self, optimizer: Optional[Any] = None) -> Update:
        """The update, built for every step from the module's parts as they are now (a `module.algorithm` replaced
        between steps takes effect at the next). Without a trainer (tests, notebooks): `optimizer` (None: loss
        passes only), plain autograd, no callbacks."""
        fitting, algorithm = self._trainer is not None, self.algorithm
        contexts = [functools.partial(cb.loss_context, self.trainer, self) for cb in self.rl_callbacks()]
        return Update(self.policy, self.optimizers() if fitting else optimizer,
                      self.lr_schedulers() if fitting else None, loss=algorithm.loss, update=algorithm.update,
                      grad_clip=algorithm.grad_clip, temperature=algorithm.temperature,
                      norm_len=algorithm.max_new_tokens, policy_loss=self.policy_loss,
                      correction=RolloutCorrector(algorithm.rollout_correction), ref_policy=self.ref_policy,
                      loss_contexts=contexts, backward=self.manual_backward if fitting else None,
                      model=self.update_policy(), counters=self.counters, timer=self.timer, device=self.device,
                      token_metrics=self.token_metrics, sequence_metrics=self.sequence_metrics,
                      hint=self._checkpoint_hint)

    def update_policy(self) -> nn.Module:
        """The policy as the loss runs it: compiled once with `model.compile` (dynamic shapes: micro-batches of any
        size and width reuse one graph), itself otherwise. Same parameters either way."""
        if self.settings.model.compile and "policy" not in self._compiled:
            self._compiled["policy"] = torch.compile(self.policy, dynamic=True)
        return self._compiled.get("policy", self.policy)

    # -- metrics ----------------------------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, Tensor]) -> None:
        """Add metrics to this step's row (callbacks call this too)."""
        self.step_metrics.update({k: v.detach().float() if isinstance(v, Tensor) else torch.tensor(float(v))
                                  for k, v in metrics.items()})

    def _log_step(self, rollouts: Rollouts, step_s: float) -> None:
        flops = self.flops.metrics(rollouts, self.timer.times, passes=self.algorithm.ppo_epochs,
                                   reference=self.ref_policy is not None, recompute=recomputes_forward(self.policy),
                                   old_forward=not self.algorithm.rollout_correction.bypass)
        self.log_metrics(step_row(rollouts, self.counters, self.step_rollouts_start, self.timer, step_s,
                                  {**flops, **env_metrics(rollouts), **self.source.shares(step_s)}))
        self.step_metrics = D.reduce_metrics(self.step_metrics)  # the global batch's figures, on every rank
        write_step_metrics(self.trainer, self.step_metrics, progress_bar=("reward/mean", "reward/accuracy"))

    # -- evaluation --------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        if self.engine is None:
            self.setup("validate")
        # the engine keys its seed per prompt: every evaluation draws the same samples
        self.val_metrics.update(self.source.evaluate(batch, self.algorithm.eval_samples,
                                                     seed=seed_of("eval", self.settings.seed)))  # [B, n]

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute(), on_epoch=True, prog_bar=True)
        self.val_metrics.reset()
        if self.trainer.state.fn == "fit":  # a row logged inside fit carries the step before the policy's: say which
            counters = self.counters.global_values()
            self.log_dict({"val/rl_steps": float(counters["rl_steps"]),
                           "val/rollouts_total": float(counters["rollouts_total"])}, on_epoch=True)

    # -- state -------------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the run's totals (every rank saves, one file is written; a resume gives them to rank 0, 0 to the others)
        # with the source's version (`rl_steps`), and in async mode the batches in flight (generated again on resume)
        checkpoint["lit_rlvr"] = {"counters": self.counters.global_values(), "model_path": self.model_path,
                                  "rng": rng_states(), **(self.source.state_dict() if self.source else {})}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("lit_rlvr", {})
        self.counters.restore(state.get("counters", {}), self.global_rank)  # with the source's version
        self._restored = state  # (`load_from_checkpoint` loads before `setup` builds the source)
        if self.source is not None:  # the batches in flight; the engine takes the restored weights
            self.source.load_state_dict(state)
        if "rng" in state:  # a resumed run draws the random numbers the uninterrupted run would have drawn
            set_rng_states(state["rng"])
