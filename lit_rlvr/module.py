"""`GRPOModule`: the LightningModule of one RL step (DESIGN §3).

rollout → reward → advantages → PPO-clip loss over micro-batches → optimizer step → engine weight sync.
Subclass points: `compute_advantages`, `policy_loss`, `configure_optimizers`. Methods that change the plan,
the baseline or the weights the gradient is taken at are `RLVRCallback`s (lit_rlvr.hooks).
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import logging
import time
import zlib
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lit_rlvr import distributed as D
from lit_rlvr import functional as F
from lit_rlvr.hooks import RLVRCallback
from lit_rlvr.models import load_policy, resolve_model_path
from lit_rlvr.optim.schedule import warmup_factor
from lit_rlvr.rewards import build_reward_runner
from lit_rlvr.rewards.base import RewardHangError
from lit_rlvr.rollout import build_engine
from lit_rlvr.rollout.engine import EngineError, SamplingParams  # EngineError: also lit_rlvr.module.EngineError
from lit_rlvr.rollout.weights import push_weights
from lit_rlvr.rollouts import RolloutPlan, Rollouts, rollouts_from_completions
from lit_rlvr.validation import ValidationMetrics

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "ivon")


class NonFiniteError(RuntimeError):
    pass


def rng_states() -> dict[str, Any]:
    """The global RNG states (python, numpy, torch CPU and CUDA) for a checkpoint; Lightning does not save them."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # plain types and tensors only, so checkpoints load with torch.load(weights_only=True) (Lightning's default)
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    states = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


class FreezeSetupObjects(pl.Callback):
    """`gc.freeze()` for the length of `fit`: what exists at its start (imported modules, the model, configs: ~500k
    objects on the tiny workload) lives for the whole run, and Python's periodic full collection rescanned all of
    it — 0.33 s every ~30 steps, ~1/3 of the mean step. Unfrozen when fit ends, also by an exception (garbage
    frozen with the rest is collected then). `GRPOModule.configure_callbacks` adds it."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gc.freeze()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            gc.unfreeze()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        gc.unfreeze()


class GRPOModule(pl.LightningModule):
    """GRPO with PPO-clip (Shao et al. 2024) and the usual knobs; see DESIGN §4 for every option.

    Args (the ones a user changes most): `group_size` G samples per prompt; `lr`; `eps_low`/`eps_high` clip
    range; `dual_clip` c (> 1: verl's clip_ratio_c; None = off); `loss_aggregation` (one of
    `functional.AGGREGATIONS`); `scale_adv_by_std`; `kl_coef` β (> 0 loads a frozen reference copy) with
    `kl_estimator` (and `kl_k3_cap`: verl caps k3 at 10; None = no cap); `entropy_coef` η; `ppo_epochs` passes
    over each rollout batch; `mini_batches` optimizer steps per epoch; `micro_batch_size` completions per
    forward/backward; `micro_batch_tokens` (None = off) packs completions of similar length into micro-batches of
    at most that many padded tokens, prompt included (and at most `micro_batch_size` rows; see
    `functional.micro_batches`). `warmup_steps` W: linear lr warm-up over the first W optimizer updates (`warmup_from_zero`:
    verl's shape, from lr 0; see `lit_rlvr.optim.schedule.warmup_factor`).
    `optimizer`: `adamw` (uses `betas`, `weight_decay`) or `ivon` (`lit_rlvr.optim.IVON`, for 3PO; `lr` plus
    `optimizer_options`: ess λ (required), hess_init, beta1, beta2, weight_decay δ, clip_radius, …); extra
    `optimizer_options` go to the optimizer's constructor either way.
    """

    # loss metrics that are means over response tokens, and over sequences (a subclass may move one)
    token_metrics = frozenset({"loss/entropy", "loss/pg_clipfrac", "loss/pg_clipfrac_lower", "loss/approx_kl"})
    sequence_metrics = frozenset({"loss/seq_mask_frac"})

    def __init__(
        self,
        model: str = "tiny",
        model_options: Optional[dict[str, Any]] = None,
        dtype: str = "float32",
        reward: str = "arithmetic",
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
        chat_template: bool = False,
        eval_samples: int = 1,
        eval_temperature: float = 0.0,
        max_bad_steps: int = 5,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self._check_options()
        path = resolve_model_path(model, model_options)
        self.policy, self.tokenizer = load_policy(path, dtype)
        self.policy.train()  # from_pretrained returns eval mode; Lightning toggles modes itself from here
        self.model_path = path
        self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval() if kl_coef > 0 else None
        self.reward_runner = build_reward_runner(reward, reward_options)
        self.engine = None  # built in setup(): after the strategy has placed (and maybe sharded) the policy
        self.val_metrics = ValidationMetrics(eval_samples)
        self.counters = {"rollouts_total": 0, "tokens_generated": 0, "skipped_steps": 0, "bad_steps_in_row": 0, "reward_failures": 0}
        self._engine_holds_mean = False

    def _check_options(self) -> None:
        hp = self.hparams
        if hp.loss_aggregation not in F.AGGREGATIONS:
            raise ValueError(f"algorithm.loss_aggregation={hp.loss_aggregation!r}; valid: {', '.join(F.AGGREGATIONS)}")
        if hp.kl_estimator not in F.KL_ESTIMATORS:
            raise ValueError(f"algorithm.kl_estimator={hp.kl_estimator!r}; valid: {', '.join(F.KL_ESTIMATORS)}")
        for key in ("group_size", "ppo_epochs", "mini_batches", "micro_batch_size", "max_new_tokens", "eval_samples"):
            if getattr(hp, key) < 1:
                raise ValueError(f"algorithm.{key} must be >= 1, got {getattr(hp, key)}")
        if hp.micro_batch_tokens is not None and hp.micro_batch_tokens < 1:
            raise ValueError(f"algorithm.micro_batch_tokens must be >= 1 or null (off), got {hp.micro_batch_tokens}")
        if not (0 <= hp.eps_low < 1 and hp.eps_high >= 0):
            raise ValueError(f"algorithm.eps_low must be in [0, 1) and eps_high >= 0, got {hp.eps_low}, {hp.eps_high}")
        if hp.dual_clip is not None and not hp.dual_clip > 1:
            raise ValueError(f"algorithm.dual_clip={hp.dual_clip}: the dual-clip bound c must be > 1 (verl: 3.0); "
                             "null turns it off")
        if hp.kl_k3_cap is not None and (hp.kl_estimator != "k3" or not hp.kl_k3_cap > 0):
            raise ValueError(f"algorithm.kl_k3_cap={hp.kl_k3_cap} caps the k3 estimator: it needs algorithm."
                             f"kl_estimator=k3 (got {hp.kl_estimator}) and a cap > 0 (verl: 10); null = no cap")
        self.sampling_params(0)  # SamplingParams validates temperature, top_p, max_new_tokens
        self._check_optimizer_options()

    def _check_optimizer_options(self) -> None:
        hp = self.hparams
        if hp.optimizer not in OPTIMIZERS:
            raise ValueError(f"algorithm.optimizer={hp.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if hp.optimizer != "ivon":
            return
        if hp.grad_clip or hp.weight_decay:
            # IVON records each sample's gradient before the module could clip it, and its δ sets σ
            raise ValueError("with algorithm.optimizer=ivon set algorithm.grad_clip=0 and algorithm.weight_decay=0; "
                             "IVON bounds its step by optimizer_options.clip_radius and takes δ from "
                             "optimizer_options.weight_decay")
        from lit_rlvr.optim import IVON

        valid = set(inspect.signature(IVON.__init__).parameters) - {"self", "params", "lr", "seed", "rank", "kwargs"}
        options = dict(hp.optimizer_options or {})
        unknown = set(options) - valid - {"sync", "debias"}
        if unknown or "ess" not in options:
            raise ValueError(f"algorithm.optimizer_options for ivon: ess (λ) is required; unknown keys "
                             f"{sorted(unknown)}; valid: {', '.join(sorted(valid | {'sync', 'debias'}))}")
        if not float(options["ess"]) > 0 or not hp.lr > 0:
            raise ValueError(f"algorithm.optimizer_options.ess and algorithm.lr must be > 0 for ivon, got "
                             f"{options['ess']} and {hp.lr}")
        if options.get("hess_approx", "price") not in IVON.hessian_approx_methods:
            raise ValueError(f"algorithm.optimizer_options.hess_approx={options['hess_approx']!r}; valid: "
                             f"{', '.join(IVON.hessian_approx_methods)}")
        if options.get("mc_samples", 1) != 1:
            # ivon-opt repeats a closure that returns the loss; Lightning's manual optimization passes none
            raise ValueError(f"algorithm.optimizer_options.mc_samples={options['mc_samples']}: one gradient sample "
                             "is recorded per loss pass; for several weight samples per step use algorithm=m3po "
                             "(algorithm.callbacks.param_noise.num_samples)")
        if hp.dtype != "float32":
            # the mean moves by at most lr·(h0 + δ)·clip_radius per step (1e-6 at c3po_paper's settings), far below
            # the spacing of bf16 numbers near typical weights (~1e-4): bf16 weights would round every update away
            raise ValueError(f"algorithm.optimizer=ivon needs model.dtype=float32 (got {hp.dtype!r}): IVON's mean "
                             "updates are smaller than the spacing of half-precision weights, which would never "
                             "change. Compute can still run in bf16: trainer=gpu (bf16-mixed) or trainer=fsdp "
                             "(trainer.strategy.param_dtype=bfloat16)")

    # -- Lightning plumbing ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.engine is None:
            self.engine = build_engine(self.hparams.engine, self.policy, self.tokenizer, self.hparams.engine_options)

    def configure_model(self) -> None:
        """Lightning's parallelism hook: a sharding strategy (`FSDPRolloutStrategy.parallelize`) shards here."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self)

    def on_fit_start(self) -> None:
        if self.hparams.group_size < 2 and not any(cb.sets_sample_counts for cb in self.rl_callbacks()):
            # reached by the Lightning CLI, which skips the Hydra recipe's config checks
            raise ValueError(f"algorithm.group_size (model.init_args.group_size in the Lightning CLI) = "
                             f"{self.hparams.group_size}: advantages compare the completions of one prompt, so a "
                             "group of one learns nothing; use 2 or more")
        self._engine_to_device()

    def configure_callbacks(self) -> list[pl.Callback]:
        return [FreezeSetupObjects()]

    def on_validation_start(self) -> None:
        self._engine_to_device()

    def _engine_to_device(self) -> None:
        """A `copy` engine was built before the strategy placed the policy: put it on the trainer's device."""
        if self.engine is not None and hasattr(self.engine, "to"):
            self.engine.to(self.device)

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self.engine is not None:
            self.engine.sleep()

    def configure_optimizers(self):
        hp = self.hparams
        options = dict(hp.optimizer_options or {})
        if hp.optimizer == "ivon":
            from lit_rlvr.optim import IVON

            from lit_rlvr.strategies import FSDPRolloutStrategy

            if self.trainer.world_size > 1 and not isinstance(self.trainer.strategy, FSDPRolloutStrategy):
                # each DDP rank would pair its own noise with the averaged gradient: their Hessians, then their
                # weights, drift apart; FSDP2 perturbs each shard once, on the rank that holds it
                raise ValueError(f"algorithm.optimizer=ivon on {self.trainer.world_size} ranks needs trainer=fsdp "
                                 f"(or fsdp32); this run's strategy is {type(self.trainer.strategy).__name__}")
            # run seed and rank seed the weight samples: reproducible, resumable, different per data-parallel rank
            optimizer = IVON(self.policy.parameters(), lr=hp.lr, seed=hp.seed, rank=self.global_rank, **options)
        else:
            params = list(self.policy.parameters())
            # the fused kernel: one call for all tensors (~3x faster than the per-tensor loop on a small model);
            # sharded (DTensor) parameters keep torch's own choice
            options.setdefault("fused", not any(hasattr(p, "full_tensor") for p in params) or None)
            optimizer = torch.optim.AdamW(params, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay,
                                          **options)
        factor = functools.partial(warmup_factor, warmup_steps=hp.warmup_steps, from_zero=hp.warmup_from_zero)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def rl_callbacks(self) -> list[RLVRCallback]:
        trainer = self._trainer
        return [cb for cb in (trainer.callbacks if trainer else []) if isinstance(cb, RLVRCallback)]

    # -- one RL step -----------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int):
        t_start = time.perf_counter()
        self.step_metrics: dict[str, Tensor] = {}
        self.step_times = {"gen_s": 0.0, "reward_s": 0.0, "train_s": 0.0, "sync_s": 0.0}
        self.step_rollouts_start = self.counters["rollouts_total"]
        rollouts = self.collect_rollouts(batch)
        self.engine.sleep()  # SGLang frees its KV cache and weights while the trainer needs the memory
        for cb in self.rl_callbacks():
            cb.on_before_advantages(self.trainer, self, rollouts)
        rollouts.advantages, adv_metrics = self.compute_advantages(rollouts)
        self.log_metrics(adv_metrics)
        t0 = time.perf_counter()
        self.update(rollouts)
        self.step_times["train_s"] += time.perf_counter() - t0
        self.sync_engine()
        for cb in self.rl_callbacks():
            cb.on_rl_step_end(self.trainer, self, rollouts)
        self._log_step(rollouts, time.perf_counter() - t_start)
        return None

    def collect_rollouts(self, batch: dict[str, list]) -> Rollouts:
        """Plan the batch, let the callbacks edit the plan, generate and score. Subclasses that need more
        prompts than one batch (DAPO's dynamic sampling) override this and call it once per batch."""
        plan = self.make_plan(batch)
        for cb in self.rl_callbacks():
            cb.on_rollout_plan(self.trainer, self, plan)
        return self.rollout(plan)

    def make_plan(self, batch: dict[str, list]) -> RolloutPlan:
        prompts = [self.render_prompt(p) for p in batch["prompt"]]
        token_ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
        return RolloutPlan(prompts, list(batch["answer"]), token_ids, [self.hparams.group_size] * len(prompts))

    def render_prompt(self, prompt: Any) -> str:
        if isinstance(prompt, str) and not self.hparams.chat_template:
            return prompt
        from lit_rlvr.data.formats import render_prompt

        return render_prompt(prompt, self.tokenizer, chat_template=self.hparams.chat_template)

    def sampling_params(self, seed: int, *, evaluation: bool = False) -> SamplingParams:
        hp = self.hparams
        temperature = hp.eval_temperature if evaluation else hp.temperature
        return SamplingParams(temperature=temperature, top_p=hp.top_p, top_k=hp.top_k,
                              max_new_tokens=hp.max_new_tokens, seed=seed, stop_token_ids=self.stop_token_ids())

    def stop_token_ids(self) -> tuple[int, ...]:
        """Where sampling stops besides the tokenizer's eos: the eos ids of the model's generation config (e.g. a
        chat model that ends a turn with one token and a document with another)."""
        eos = getattr(getattr(getattr(self, "policy", None), "generation_config", None), "eos_token_id", None)
        if eos is None:  # also while __init__ checks the options, before the model loads
            return ()
        ids = eos if isinstance(eos, (list, tuple)) else [eos]
        return tuple(sorted({int(i) for i in ids} - {self.tokenizer.eos_token_id}))

    def sample_seed(self, *parts: int) -> int:
        """Seed of one engine call: a function of the run seed, the step and the call's place in it. Not of the
        rank: the engine keys each completion by its prompt, so any world size samples the same completions."""
        key = ":".join(str(p) for p in (self.hparams.seed, self.global_step, *parts))
        return zlib.crc32(key.encode())

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
            rollouts = Rollouts.concat(parts, self.tokenizer.pad_token_id)
            round_index += 1
            counts = plan.budget_rule(rollouts) if plan.budget_rule is not None else None
        self.counters["rollouts_total"] += rollouts.num_samples
        self.counters["tokens_generated"] += rollouts.num_tokens()
        return rollouts

    @staticmethod
    def _another_round(counts: Optional[list[int]]) -> bool:
        """Whether any rank asks for more samples: weight pushes are collectives, so all ranks run every round."""
        return D.global_max(int(counts is not None and sum(counts) > 0)) > 0

    def _generate(self, plan: RolloutPlan, counts: list[int], source: int, round_index: int) -> Optional[Rollouts]:
        """Samples of one weight source in one round (None when `counts` are all 0; the push still happens)."""
        t0 = time.perf_counter()
        with plan.weight_context(source):
            mean = plan.uses_mean_weights and plan.num_weight_sources == 1
            if not mean or not self._engine_holds_mean or self.engine.version != self.global_step:
                self.push_to_engine(holds_mean=mean)
            if sum(counts) == 0:
                return None
            completions = self._engine_generate(plan.prompt_token_ids, counts, self.sampling_params(self.sample_seed(round_index, source)))
        self.step_times["gen_s"] += time.perf_counter() - t0
        pad = self.tokenizer.pad_token_id
        return self._score(plan, rollouts_from_completions(plan, completions, chunk=source, pad_id=pad))

    def _can_stack(self, plan: RolloutPlan, per_source: list[list[int]]) -> bool:
        """One stacked engine call for all weight sources: an engine that has one, sharing the model, and
        equal totals per source (C3PO: G/N per prompt each)."""
        totals = {sum(c) for c in per_source}
        return (plan.num_weight_sources > 1 and hasattr(self.engine, "generate_stacked")
                and getattr(self.engine, "mode", None) == "shared" and len(totals) == 1 and totals != {0})

    def _generate_stacked(self, plan: RolloutPlan, per_source: list[list[int]], round_index: int) -> list[Rollouts]:
        """What `_generate` gives for every source, from one engine call: per-token overhead, not FLOPs, sets
        the cost of a small model's generation, so S calls cost ~S times one (lit_rlvr.rollout.multi_weight)."""
        t0 = time.perf_counter()
        num = plan.num_weight_sources
        stacks = plan.weight_stacks(num) if plan.weight_stacks is not None else self._stacks_from_contexts(plan)
        self.push_to_engine(holds_mean=False)  # shared mode: no copy; the version bookkeeping of `_generate`
        sampling = [self.sampling_params(self.sample_seed(round_index, s)) for s in range(num)]
        with self._engine_errors():
            completions = self.engine.generate_stacked(plan.prompt_token_ids, per_source, sampling, stacks)
        self.step_times["gen_s"] += time.perf_counter() - t0
        pad = self.tokenizer.pad_token_id
        packed = [rollouts_from_completions(plan, c, chunk=source, pad_id=pad) for source, c in enumerate(completions)]
        return [self._score(plan, Rollouts.concat(packed, pad))]  # one decode and one reward call for all sources

    @torch.no_grad()
    def _stacks_from_contexts(self, plan: RolloutPlan) -> dict[Tensor, Tensor]:
        """{param: [S, *shape]}: row c copied from the params inside `plan.weight_context(c)`."""
        params = list(self.engine.model.parameters())
        stacks = {p: p.new_empty((plan.num_weight_sources, *p.shape)) for p in params}
        for source in range(plan.num_weight_sources):
            with plan.weight_context(source):  # 3PO writes θ̂_source into the params; m is back on exit
                for p in params:
                    stacks[p][source].copy_(p)
        return stacks

    def _score(self, plan: RolloutPlan, part: Rollouts) -> Rollouts:
        """Decode the packed completions and score their rewards."""
        pad = self.tokenizer.pad_token_id
        part.completions = self.tokenizer.batch_decode(part.response_ids.masked_fill(~part.response_mask, pad),
                                                       skip_special_tokens=True)
        t0 = time.perf_counter()
        owners = part.group.tolist()  # [N] prompt of each completion
        scored = self.reward_runner([plan.prompts[g] for g in owners], part.completions,
                                    [plan.answers[g] for g in owners])
        if getattr(self.reward_runner, "stop_reason", None):  # a hung call is left running: finish, save, stop
            self.trainer.should_stop = True
        part.rewards, part.malformed = scored.scores, scored.malformed
        self.counters["reward_failures"] += scored.failures
        self.step_times["reward_s"] += time.perf_counter() - t0
        return part

    def _engine_generate(self, prompt_token_ids: list[list[int]], counts: list[int], params: SamplingParams):
        with self._engine_errors():
            return self.engine.generate(prompt_token_ids, counts, params)

    @contextmanager
    def _engine_errors(self) -> Iterator[None]:
        """An engine failure becomes an `EngineError` that says what survives and what to do."""
        try:
            yield
        except Exception as err:
            raise EngineError(f"engine {self.hparams.engine!r} failed at step {self.global_step + 1}: {err!r}; "
                              f"{self._checkpoint_hint()}") from err

    def _checkpoint_hint(self) -> str:
        """What a stopped run keeps: the last checkpoint, if one was written (never claim one that is not there)."""
        callbacks = self._trainer.callbacks if self._trainer is not None else []
        path = next((cb.last_path for cb in callbacks if hasattr(cb, "last_path")), None)
        if path is not None and Path(path).exists():
            return f"the last checkpoint {path} is intact: fix the cause and continue with resume={path}"
        return "no checkpoint was written yet (the run stopped before its first save): fix the cause and start again"

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # after the callbacks' hook: RunCheckpoint has saved this step (should_stop was set in `_score`)
        reason = getattr(self.reward_runner, "stop_reason", None)
        if reason:
            raise RewardHangError(f"{reason}; {self._checkpoint_hint()}")

    def push_to_engine(self, *, holds_mean: bool = True) -> None:
        """Send the policy's current weights to the engine (no copy in `shared` mode); wakes a sleeping engine."""
        t0 = time.perf_counter()
        self.engine.wake()
        if getattr(self.engine, "mode", None) != "shared":
            push_weights(self.engine, self.policy, bucket_bytes=getattr(self.engine, "bucket_bytes", 256 << 20),
                         dtype=getattr(self.engine, "weight_dtype", None))
        self.engine.version = self.global_step
        self._engine_holds_mean = holds_mean
        self.step_times["sync_s"] = self.step_times.get("sync_s", 0.0) + time.perf_counter() - t0

    def sync_engine(self) -> None:
        """After the optimizer step: the engine must hold the new mean weights (version = global step)."""
        self.push_to_engine(holds_mean=True)

    # -- advantages and loss (subclass points) ----------------------------------------------------------------
    def compute_advantages(self, rollouts: Rollouts) -> tuple[Tensor, dict[str, Tensor]]:
        """[N] advantages; uses `rollouts.baseline` and `rollouts.scale_adv_by_std` when a callback set them (V0.5)."""
        scale = self.hparams.scale_adv_by_std if rollouts.scale_adv_by_std is None else rollouts.scale_adv_by_std
        group, num_groups = rollouts.advantage_groups()  # the prompts, or smaller groups set by a callback (M3PO)
        return F.grpo_advantages(rollouts.rewards, group, num_groups, scale_by_std=scale, baseline=rollouts.baseline)

    def policy_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, rollouts: Rollouts) -> tuple[Tensor, dict[str, Tensor]]:
        """Surrogate loss of one micro-batch. logp, old_logp, mask: [n, T]; advantages: [n]."""
        hp = self.hparams
        return F.ppo_clip_loss(logp, old_logp, advantages, mask, eps_low=hp.eps_low, eps_high=hp.eps_high,
                               aggregation=hp.loss_aggregation, norm_len=hp.max_new_tokens, dual_clip=hp.dual_clip)

    def forward_logprobs(self, model, rollouts: Rollouts) -> tuple[Tensor, Tensor]:
        """Log-probs [n, T] of the response tokens at the sampling temperature, and the logits [n, T, V]."""
        ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1).to(self.device)  # [n, P+T]
        mask = torch.cat([rollouts.prompt_mask, rollouts.response_mask], dim=1).to(self.device)  # [n, P+T]
        position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
        width = rollouts.response_ids.shape[1]
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=width + 1).logits[:, :-1]
        temperature = self.hparams.temperature or 1.0
        return F.token_logprobs(logits, rollouts.response_ids.to(self.device), temperature=temperature), logits

    def micro_batch_loss(self, rollouts: Rollouts, weight: float) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch, scaled by its share `weight` of the pass so micro-batches sum exactly."""
        hp = self.hparams
        logp, logits = self.forward_logprobs(self.policy, rollouts)  # [n, T], [n, T, V]
        mask = rollouts.response_mask.to(self.device)
        old = rollouts.old_logp.to(self.device)
        advantages = rollouts.advantages.to(self.device)  # [n]
        keep_metrics = {}
        if rollouts.seq_mask_tau is not None:
            # 3PO: a sequence whose ratio left [1/τ, τ] gets no policy gradient. Its terms become 0 but its tokens
            # stay in every normalisation, as the micro-batch weights assume: the loss cannot depend on micro-batching
            keep, keep_metrics = F.sequence_importance_mask(logp, old, mask, tau=rollouts.seq_mask_tau)  # [n]
            advantages = advantages * keep  # [n]
        loss, metrics = self.policy_loss(logp, old, advantages, mask, rollouts)
        metrics.update(keep_metrics)
        with torch.set_grad_enabled(hp.entropy_coef > 0):
            entropy = F.entropy_from_logits(logits / (hp.temperature or 1.0))  # [n, T]
        entropy_mean = F.aggregate(entropy, mask, hp.loss_aggregation, norm_len=hp.max_new_tokens)
        loss = loss - hp.entropy_coef * entropy_mean
        # the metric is nats per token whatever the loss aggregation, so runs of different losses compare
        metrics["loss/entropy"] = F.aggregate(entropy.detach(), mask, "token-mean")
        if self.ref_policy is not None:
            with torch.no_grad():
                ref_logp, _ = self.forward_logprobs(self.ref_policy, rollouts)
            per_token = F.kl_penalty(logp, ref_logp, estimator=hp.kl_estimator, k3_cap=hp.kl_k3_cap)  # [n, T]
            kl = F.aggregate(per_token, mask, hp.loss_aggregation, norm_len=hp.max_new_tokens)
            loss = loss + hp.kl_coef * kl
            metrics["loss/kl_ref"] = kl.detach()
        metrics["loss/policy"] = loss.detach()
        return loss * weight, metrics

    def update(self, rollouts: Rollouts) -> None:
        """`ppo_epochs` × `mini_batches` optimizer steps; each step runs the loss passes (one per weight sample
        for M3PO) inside the callbacks' loss contexts, micro-batch by micro-batch."""
        hp = self.hparams
        optimizer = self.optimizers()
        # every rank takes the same number of optimizer steps (FSDP's collectives), each on at least one rollout:
        # a batch smaller than mini_batches on some rank (DAPO kept few groups) gets one step per rollout
        fewest = -D.global_max(-rollouts.num_samples)
        if fewest < hp.mini_batches:
            log.warning("step %d: a rank holds %d rollouts, fewer than algorithm.mini_batches=%d: %d optimizer steps",
                        self.global_step, fewest, hp.mini_batches, fewest)
        steps = min(hp.mini_batches, fewest)
        order = torch.arange(rollouts.num_samples)
        loss_sums: dict[str, Tensor] = {}  # per-pass metrics, summed over passes
        grad_norms: list[Tensor] = []
        passes = 0
        for _epoch in range(hp.ppo_epochs):
            for mini in order.tensor_split(steps):  # exactly that many (torch.chunk can give fewer)
                optimizer.zero_grad()
                earlier_finite = True
                for n, (pass_index, index) in enumerate(self._loss_passes(rollouts, mini)):
                    if n:  # M3PO: the next pass's context clears .grad, so the previous pass's is checked first
                        earlier_finite &= bool(torch.isfinite(self._grad_norm()))
                    self._backward_pass(rollouts.select(index), pass_index, loss_sums)
                    passes += 1
                grad_norms.append(self._optimizer_step(optimizer, loss_sums, earlier_finite))
        self.log_metrics({k: v / passes for k, v in loss_sums.items()})
        self.log_metrics({"grad/norm": torch.stack(grad_norms).mean()})

    @staticmethod
    def _loss_passes(rollouts: Rollouts, mini: Tensor) -> list[tuple[int, Tensor]]:
        if rollouts.loss_pass is None:
            return [(0, mini)]
        passes = rollouts.loss_pass[mini]
        return [(int(p), mini[passes == p]) for p in torch.unique(passes)]

    def _backward_pass(self, rollouts: Rollouts, pass_index: int, sums: dict[str, Tensor]) -> None:
        """Backward of one loss pass, micro-batch by micro-batch. Each micro-batch's loss is weighted by its share
        of the global pass (tokens for token-mean, else sequences) times the world size, since data-parallel
        gradients are averaged over ranks: the sum equals the loss of the whole global batch. Metrics are
        weighted the same way by what they average over (`token_metrics`, `sequence_metrics`, else the loss's
        unit), so they do not depend on the micro-batching or the number of ranks."""
        hp = self.hparams
        tokens = rollouts.response_mask.sum(-1).double()  # [n]
        world = D.world_size()
        totals = torch.tensor([float(tokens.sum()), float(rollouts.num_samples)], dtype=torch.float64)
        total_tokens, total_seqs = D.all_reduce(totals).clamp_min(1).tolist()
        lengths = rollouts.prompt_mask.sum(-1) + rollouts.response_mask.sum(-1)  # [n]
        width = None if hp.micro_batch_tokens else rollouts.prompt_ids.shape[1] + rollouts.response_ids.shape[1]
        micros, micro_metrics = F.micro_batches(lengths, max_rows=hp.micro_batch_size, max_tokens=hp.micro_batch_tokens,
                                                width=width)  # untrimmed fixed micro-batches run at the full width
        for k, v in micro_metrics.items():  # averaged over passes with the other pass metrics
            sums[k] = sums.get(k, 0.0) + v
        # FSDP gathers weights in every forward: ranks with fewer micro-batches run zero-weight ones on sample 0
        padding = D.global_max(len(micros)) - len(micros)
        with ExitStack() as stack:
            for cb in self.rl_callbacks():
                stack.enter_context(cb.loss_context(self.trainer, self, rollouts, pass_index))
            for i, micro in enumerate(micros + [torch.zeros(1, dtype=torch.long)] * padding):
                real = i < len(micros)
                token_w = float(tokens[micro].sum()) / total_tokens * world if real else 0.0
                seq_w = len(micro) / total_seqs * world if real else 0.0
                share = token_w if hp.loss_aggregation == "token-mean" else seq_w
                part = rollouts.select(micro)
                loss, metrics = self.micro_batch_loss(part.trim_padding() if hp.micro_batch_tokens else part, share)
                self.manual_backward(loss)
                for k, v in (metrics.items() if real else ()):
                    w = token_w if k in self.token_metrics else seq_w if k in self.sequence_metrics else share
                    sums[k] = sums.get(k, 0.0) + v * w

    def _grad_norm(self) -> Tensor:
        """The policy's gradient norm, over all shards under FSDP2."""
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor

    def _optimizer_step(self, optimizer, sums: dict[str, Tensor], earlier_finite: bool = True) -> Tensor:
        """Clip, check finiteness (also of the loss passes before the last: `earlier_finite`), step; returns the
        gradient norm before clipping."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        clip = self.hparams.grad_clip if self.hparams.grad_clip and self.hparams.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip) if params else torch.tensor(0.0)
        if hasattr(norm, "full_tensor"):  # FSDP2: the norm over all shards, as a DTensor
            norm = norm.full_tensor()
        loss_ok = bool(torch.isfinite(sums.get("loss/policy", torch.tensor(0.0))))
        if not (loss_ok and earlier_finite and bool(torch.isfinite(norm))):
            self._skip_step(optimizer, "loss" if not loss_ok else "gradient")
            return norm.detach()
        self.counters["bad_steps_in_row"] = 0
        optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        return norm.detach()

    def _skip_step(self, optimizer, what: str) -> None:
        self.counters["skipped_steps"] += 1
        self.counters["bad_steps_in_row"] += 1
        optimizer.zero_grad()
        discard = getattr(optimizer, "discard_samples", None)  # IVON: this step's gradient samples must not leak
        if discard is not None:
            discard()
        log.warning("non-finite %s at step %d: step skipped (%d in a row)", what, self.global_step, self.counters["bad_steps_in_row"])
        if self.counters["bad_steps_in_row"] >= self.hparams.max_bad_steps:
            raise NonFiniteError(
                f"{self.counters['bad_steps_in_row']} non-finite steps in a row (algorithm.max_bad_steps="
                f"{self.hparams.max_bad_steps}); lower algorithm.lr or check the reward; {self._checkpoint_hint()}")

    # -- metrics ----------------------------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, Tensor]) -> None:
        """Add metrics to this step's row (callbacks call this too)."""
        self.step_metrics.update({k: v.detach().float() if isinstance(v, Tensor) else torch.tensor(float(v)) for k, v in metrics.items()})

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
            **{f"time/{k}": torch.tensor(v) for k, v in self.step_times.items()},
        }
        self.log_metrics(metrics)
        self.step_metrics = D.reduce_metrics(self.step_metrics)  # the global batch's figures, on every rank
        self._write_step_metrics(self.step_metrics, progress_bar=("reward/mean", "reward/accuracy"))

    def _write_step_metrics(self, metrics: dict[str, Tensor], progress_bar: tuple[str, ...] = ()) -> None:
        """One row per step to every logger, the values to `trainer.callback_metrics` (for monitors) and the
        `progress_bar` keys to the progress bar.

        Not through `self.log`: Lightning's per-key bookkeeping costs ~1-2 ms per metric and call, about a third
        of a tiny-model step with ~25 metrics (measured with cProfile on the reference workload). This is what
        its logger connector does with on-step metrics, in one call."""
        connector = self.trainer._logger_connector
        connector._callback_metrics.update(metrics)
        connector._progress_bar_metrics.update({k: float(metrics[k]) for k in progress_bar})
        if connector.should_update_logs or self.trainer.should_stop:
            connector.log_metrics(dict(metrics))

    # -- evaluation --------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        if self.engine is None:
            self.setup("validate")
        plan = self.make_plan(batch)
        if not self._engine_holds_mean or self.engine.version != self.global_step:
            self.step_times = {}
            self.push_to_engine()
        n = self.hparams.eval_samples
        params = self.sampling_params(zlib.crc32(f"eval:{self.hparams.seed}".encode()), evaluation=True)  # keyed per prompt by the engine
        completions = self.engine.generate(plan.prompt_token_ids, [n] * plan.num_prompts, params)
        texts = [[self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in per] for per in completions]
        flat = [t for per in texts for t in per]
        owners = [b for b, per in enumerate(texts) for _ in per]
        scored = self.reward_runner([plan.prompts[b] for b in owners], flat, [plan.answers[b] for b in owners])
        if getattr(self.reward_runner, "stop_reason", None):
            raise RewardHangError(f"{self.reward_runner.stop_reason} (in validation)")
        correct = (scored.scores > 0).view(plan.num_prompts, n)  # [B, n]
        self.val_metrics.update(correct)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute(), on_epoch=True, prog_bar=True)
        self.val_metrics.reset()

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
        self._engine_holds_mean = False  # the engine must receive the restored weights before the next rollout
