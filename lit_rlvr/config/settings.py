"""The run's settings as typed, frozen dataclasses: one class per Hydra group, each default defined once.

`train.py` (Hydra builds them from the composed config), the Lightning CLI (the same nested names under
`model.init_args.`) and Python (`GRPOModule(algorithm=AlgorithmConfig(lr=1e-4))`) all construct these classes, so
they share one default and one check per setting. A field's metadata carries its valid range (`rule`: a predicate
and what is expected, for the one-line error) and whether a resumed run may change it (`on_resume`); the range
table that every entry point checks (`lit_rlvr.config.options.RANGES`) and the resume check's list of changeable
keys (`lit_rlvr.run.resume`) are read off these fields (`rows`, `resume_mutable`).

The `algorithm` group is flat in the YAML (`algorithm.lr`, `algorithm.eps_low`), as verl's and TRL's users know it;
`AlgorithmConfig` is the union of the parts the code takes separately (`OptimConfig`, `LossConfig`, `UpdateConfig`,
`SamplingOptions`), each a view (`algorithm.loss`, `algorithm.update`, ...).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.rollout_correction import RolloutCorrection
from lit_rlvr.config.problems import checked_fields, convert, finite_problems, problem_line
from lit_rlvr.functional import ADVANTAGES, AGGREGATIONS, GROUP_FILTER_METRICS, KL_ESTIMATORS, POLICY_LOSSES

Rule = tuple[Callable[[Any], bool], str]  # (is the value valid?, what is expected)


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def at_least(low: int, what: str = "an integer") -> Rule:
    """An integer >= `low` (a bool, a float or a string is not one, whatever its value)."""
    return (lambda v: _integer(v) and v >= low, f"{what} >= {low}")


MAX_GROUP_SIZE = 65536  # samples per prompt: RLVR recipes use 4 to 512

# a run's seed (`seed`, `data.seed`): numpy's range, which Lightning's `seed_everything` refuses to leave in a message
# that names no key
SEED: Rule = (lambda v: _integer(v) and 0 <= v < 2 ** 32, "an integer in [0, 4294967295] (numpy's seed range)")


def optional(rule: Rule) -> Rule:
    """`rule`, or null."""
    return (lambda v: v is None or rule[0](v), f"{rule[1]}, or null")


def one_of(names: Any) -> Rule:
    return (lambda v: v in names, f"one of {', '.join(names)}")


POSITIVE: Rule = (lambda v: _real(v) and v > 0, "a number > 0")
NON_NEGATIVE: Rule = (lambda v: _real(v) and v >= 0, "a number >= 0")
TEXT: Rule = (lambda v: isinstance(v, str) and bool(v), "a non-empty string")
BOOL: Rule = (lambda v: isinstance(v, bool), "true or false")
NUMBER: Rule = (_real, "a number")
MAPPING: Rule = (lambda v: isinstance(v, Mapping), "a mapping")


def setting(default: Any = MISSING, rule: Optional[Rule] = None, *, on_resume: bool = False,
            factory: Any = MISSING) -> Any:
    """A dataclass field with its range (`rule`) and whether a resume may change it (`on_resume`: the same math
    or only where and how it is measured)."""
    return field(default=default, default_factory=factory, metadata={"rule": rule, "on_resume": on_resume})


def rows(cls: type, section: str) -> Iterator[tuple[str, Rule]]:
    """(config key, rule) of every field of `cls` (and of its nested settings classes) that has a rule."""
    for f in fields(cls):
        key = f"{section}.{f.name}"
        nested = _settings_class(f)
        if nested is not None:
            yield from rows(nested, key)
        elif f.metadata.get("rule") is not None:
            yield key, f.metadata["rule"]


def resume_mutable(cls: type, section: str) -> Iterator[str]:
    """The config keys under `section` that a resumed run may change."""
    for f in fields(cls):
        key = f"{section}.{f.name}"
        nested = _settings_class(f)
        if nested is not None:
            yield from resume_mutable(nested, key)
        elif f.metadata.get("on_resume"):
            yield key


def _settings_class(f: Any) -> Optional[type]:
    factory = f.default_factory
    return factory if isinstance(factory, type) and hasattr(factory, "__dataclass_fields__") else None


def field_problems(values: Mapping[str, Any], cls: type, section: str) -> list[str]:
    """One line per value of `values` (field name -> value) that its field's rule in `cls` rejects."""
    rules = dict(rows(cls, section))
    problems = []
    for name, value in values.items():
        rule = rules.get(f"{section}.{name}")
        if rule is None:
            continue
        try:
            ok = rule[0](value)
        except TypeError:  # e.g. null where a number is needed
            ok = False
        if not ok:
            problems.append(problem_line(f"{section}.{name}", value, rule[1]))
    return problems


def check_fields(settings: Any, section: str) -> None:
    """A settings object's own values against its fields' rules, and every float finite (`finite_problems`): a
    `ConfigError`, one line per bad value, wherever the object is built (train.py, the CLI, Python, `replace`)."""
    values = {f.name: getattr(settings, f.name) for f in fields(settings)}
    problems = finite_problems(values, section) or field_problems(values, type(settings), section)
    ConfigError.check(problems)


def part(cls: type, source: Any) -> Any:
    """The fields of dataclass `cls` read off `source` (a larger settings object with the same field names)."""
    return cls(**{f.name: getattr(source, f.name) for f in fields(cls)})


# -- the algorithm group -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its schedule. `optimizer`: `adamw` (uses `betas`, `weight_decay`) or `ivon`
    (`lit_rlvr.optim.IVON`, for 3PO: `optimizer_options` must give `ess` λ). `optimizer_options` go to the
    optimizer's constructor. `warmup_steps` W: linear warm-up over the first W updates (`warmup_from_zero`: verl's
    shape, from lr 0). `grad_clip`: the gradient norm's bound (0 or null = off). lr 3e-4 is the tiny CPU default's
    best by measurement (docs/results/tiny_presets.md); 1e-6 is usual for 4B+ models."""

    optimizer: str = setting("adamw", one_of(("adamw", "ivon")))
    lr: float = setting(3.0e-4, POSITIVE)
    betas: tuple[float, float] = setting((0.9, 0.999), (lambda v: len(v) == 2 and all(_real(b) and 0 <= b < 1
                                                                                  for b in v),
                                                        "two numbers in [0, 1) (Adam's β1, β2)"))
    weight_decay: float = setting(0.0, NON_NEGATIVE)
    warmup_steps: int = setting(0, at_least(0))
    warmup_from_zero: bool = setting(False, BOOL)
    grad_clip: Optional[float] = setting(1.0, (lambda v: v is None or _real(v) and v >= 0, "a number >= 0 (0 = off) "
                                                                                          "or null"))
    optimizer_options: dict[str, Any] = setting(rule=MAPPING, factory=dict)


@dataclass(frozen=True)
class LossConfig:
    """The surrogate loss and the advantages: `policy_loss` and `advantages` name functions of
    `lit_rlvr.functional` (`POLICY_LOSSES`, `ADVANTAGES`); `eps_low`/`eps_high` the clip range; `dual_clip` c (> 1,
    verl's clip_ratio_c; null = off); `seq_mask_tau` τ of 3PO's sequence importance mask (null = off); `kl_coef` β
    (> 0 loads a frozen reference) with `kl_estimator` (k1 | k2 | k3 | k3+, verl's straight-through: k3's value,
    k2's gradient) and `kl_k3_cap` (verl caps k3 at 10); `entropy_coef` η; `overlong_cache_len` N and
    `overlong_penalty_factor` (verl's overlong_buffer.penalty_factor; paper: 1): DAPO's overlong reward shaping over
    the last N tokens of the budget (0 = off). `scale_adv_by_std`: GRPO's advantage divides by the group's std."""

    policy_loss: str = setting("ppo_clip", one_of(POLICY_LOSSES))
    advantages: str = setting("grpo", one_of(ADVANTAGES))
    eps_low: float = setting(0.2, (lambda v: _real(v) and 0 <= v < 1, "a number in [0, 1)"))
    eps_high: float = setting(0.2, NON_NEGATIVE)
    dual_clip: Optional[float] = setting(None, (lambda v: v is None or _real(v) and v > 1,
                                                "a number > 1 (the dual-clip bound c; verl: 3.0) or null (off)"))
    seq_mask_tau: Optional[float] = setting(None, (lambda v: v is None or _real(v) and v > 1,
                                                   "a number > 1 (the importance mask keeps ratios in [1/τ, τ]; 3PO's "
                                                   "paper: 2) or null (off)"))
    loss_aggregation: str = setting("seq-mean-token-mean", one_of(AGGREGATIONS))
    scale_adv_by_std: bool = setting(True, BOOL)
    kl_coef: float = setting(0.0, NON_NEGATIVE)
    kl_estimator: str = setting("k3", one_of(KL_ESTIMATORS))
    kl_k3_cap: Optional[float] = setting(None, (lambda v: v is None or _real(v) and v > 0,
                                                "a number > 0 (verl: 10) or null (no cap)"))
    entropy_coef: float = setting(0.0, NUMBER)
    overlong_cache_len: int = setting(0, at_least(0))
    overlong_penalty_factor: float = setting(1.0, (lambda v: _real(v) and v >= 0,
                                                   "a number >= 0 (the largest length penalty; a negative one would "
                                                   "reward length)"))


@dataclass(frozen=True)
class UpdateConfig:
    """How one batch becomes optimizer steps: `ppo_epochs` passes, `mini_batches` optimizer steps per pass,
    `micro_batch_size` completions per forward/backward, or with `micro_batch_tokens` (null = off) micro-batches of
    similar-length completions up to that many padded tokens (verl's dynamic batch size). `max_bad_steps`
    non-finite steps in a row stop the run."""

    ppo_epochs: int = setting(1, at_least(1))
    mini_batches: int = setting(1, at_least(1))
    micro_batch_size: int = setting(64, at_least(1), on_resume=True)  # memory only: the same sums
    micro_batch_tokens: Optional[int] = setting(None, (lambda v: v is None or _integer(v) and v >= 1,
                                                       "an integer >= 1 or null (off)"))
    max_bad_steps: int = setting(5, at_least(1), on_resume=True)


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling for training rollouts and evaluation. `temperature` (training) must be > 0: at 0 every completion of
    a prompt is the same greedy one and no advantage is ever nonzero; evaluation may be greedy (`eval_temperature`
    0). `ignore_eos` (benchmarks only): training completions run to `max_new_tokens` (vLLM's and SGLang's
    ignore_eos). `eval_samples` n: held-out mean@n and pass@n at `eval_temperature`."""

    temperature: float = setting(1.0, (lambda v: _real(v) and v > 0,
                                       "a number > 0 (0 would make every completion of a prompt the same greedy one; "
                                       "use algorithm.eval_temperature=0 for greedy evaluation)"))
    top_p: float = setting(1.0, (lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1]"))
    top_k: int = setting(0, (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0 = off)"))
    max_new_tokens: int = setting(8, at_least(1))
    ignore_eos: bool = setting(False, BOOL)
    eval_temperature: float = setting(1.0, (lambda v: _real(v) and v >= 0, "a number >= 0 (0 = greedy)"),
                                      on_resume=True)
    eval_samples: int = setting(4, at_least(1), on_resume=True)


FILTER_GROUPS_KEY = "algorithm.filter_groups"


@dataclass(frozen=True)
class FilterGroups:
    """verl's `algorithm.filter_groups`, DAPO's dynamic sampling (lit_rlvr.algorithms.filter_groups;
    docs/fidelity.md lists where lit-rlvr follows verl): keep the groups whose `metric` (acc | score) differs
    between their completions, refill from the next batches, at most `max_num_gen_batches` generation batches per
    step, the first included (0 = no limit; exceeding it stops the run naming the key)."""

    enable: bool = setting(False, (lambda v: isinstance(v, bool), "true or false"))
    metric: str = setting("acc", one_of(GROUP_FILTER_METRICS))
    max_num_gen_batches: int = setting(0, (lambda v: _integer(v) and v >= 0, "an integer >= 0 (generation batches "
                                           "per step, the first included; 0 = no limit)"), on_resume=True)

    @classmethod
    def from_options(cls, options: Union[None, Mapping[str, Any], "FilterGroups"]) -> "FilterGroups":
        """From a mapping of the fields (None = off); unknown keys and values out of range fail, one line each."""
        if isinstance(options, cls):
            return options
        options = checked_fields(cls, options, FILTER_GROUPS_KEY)
        ConfigError.check(field_problems(options, cls, FILTER_GROUPS_KEY))
        return cls(**options)


@dataclass(frozen=True)
class HistoryOptions:
    """What a prompt's own reward history drives (lit_rlvr.algorithms.prompt_history; docs/algorithms.md): DBB's
    discounted Beta–Bernoulli posterior (`advantages=dbb`, arXiv 2603.18444) with discount `dbb_discount` γ in (0, 1]
    (1: no discount) over a Beta(`dbb_prior_alpha`, `dbb_prior_beta`) prior that is never discounted; and
    `boundary_gating` (Bayesian Boundary Gating's intervention, arXiv 2606.15455): a prompt with a success observed
    in an earlier step gives no policy gradient (its advantages are 0). The paper's defaults could not be read where
    this was written: γ = 0.9 and Beta(1, 1) are ours."""

    dbb_discount: float = setting(0.9, (lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1] (1 = no discount)"))
    dbb_prior_alpha: float = setting(1.0, POSITIVE)
    dbb_prior_beta: float = setting(1.0, POSITIVE)
    boundary_gating: bool = setting(False, BOOL)


@dataclass(frozen=True)
class AlgorithmConfig(HistoryOptions, SamplingOptions, UpdateConfig, LossConfig, OptimConfig):
    """The `algorithm` group: `group_size` G completions per prompt, and the fields of its parts (see each class).
    `rollout_correction`: verl's options for the engine's drift (`lit_rlvr.config.rollout_correction`,
    docs/rollout_correction.md); `filter_groups`: DAPO's dynamic sampling."""

    # capped: a typo of 1e11 samples per prompt passed, and the run then sat in a loop over them that no stop reached
    group_size: int = setting(8, (lambda v: _integer(v) and 1 <= v <= MAX_GROUP_SIZE,
                                  f"an integer in [1, {MAX_GROUP_SIZE}] (samples per prompt)"))
    filter_groups: FilterGroups = setting(factory=FilterGroups)
    rollout_correction: RolloutCorrection = setting(factory=RolloutCorrection)

    def __post_init__(self) -> None:
        check_fields(self, "algorithm")
        # from a mapping (Python, a container of the composed config): the typed nested settings
        object.__setattr__(self, "filter_groups", FilterGroups.from_options(self.filter_groups))
        object.__setattr__(self, "rollout_correction", RolloutCorrection.from_options(self.rollout_correction))
        object.__setattr__(self, "betas", tuple(self.betas))

    @property
    def optim(self) -> OptimConfig:
        return part(OptimConfig, self)

    @property
    def loss(self) -> LossConfig:
        return part(LossConfig, self)

    @property
    def update(self) -> UpdateConfig:
        return part(UpdateConfig, self)

    @property
    def sampling(self) -> SamplingOptions:
        return part(SamplingOptions, self)

    @property
    def history(self) -> HistoryOptions:
        return part(HistoryOptions, self)

    @property
    def uses_history(self) -> bool:
        """Whether a run keeps each prompt's reward history (DBB's advantage or the boundary gate reads it)."""
        return self.advantages == "dbb" or self.boundary_gating


# -- the other groups ------------------------------------------------------------------------------------------------
LORA_KEY = "model.lora"


@dataclass(frozen=True)
class LoraOptions:
    """`model.lora`: LoRA adapters instead of full fine-tuning (lit_rlvr/models/lora.py builds them; docs/lora.md).

    Args:
        rank: r, the adapters' rank; None (default) trains all weights instead.
        alpha: α; the adapter's output is scaled by α / r. 32, as in "LoRA Without Regret", where the best learning
            rate then does not depend on r.
        target_modules: the linear layers that get adapters: "all-linear" (every linear layer but the output
            head, the study's recommendation: attention-only LoRA underperforms), or a list of module names
            (e.g. [q_proj, k_proj, v_proj, o_proj]), each naming layers of a kind an adapter may sit on
            (`lit_rlvr.models.lora.target_problems`).
        dropout: dropout on the adapters' input while training (0: RL compares the loss forward's log-probs with
            the sampler's, which dropout would make noisy).
        lr_scale: the optimizer's learning rate is `algorithm.lr` x lr_scale with LoRA (the study's ~10x rule,
            checked on tiny: docs/lora.md); set it to 1 to give `algorithm.lr` as the LoRA learning rate itself.
    """

    rank: Optional[int] = None
    alpha: float = 32.0
    target_modules: Any = "all-linear"  # str | tuple[str, ...] (a Hydra schema has no unions)
    dropout: float = 0.0
    lr_scale: float = 10.0

    def __post_init__(self) -> None:
        # a command line's "8" or "abc": converted here, or one line naming the key (nan/inf refused)
        rank_expected = "an integer >= 1 (the adapters' rank), or null for full fine-tuning"
        object.__setattr__(self, "rank", convert(f"{LORA_KEY}.rank", self.rank, int, optional=True,
                                                 expected=rank_expected))
        for name in ("alpha", "dropout", "lr_scale"):
            object.__setattr__(self, name, convert(f"{LORA_KEY}.{name}", getattr(self, name), float))
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"{LORA_KEY}.rank={self.rank!r}: {rank_expected}")
        if not self.alpha > 0:
            raise ValueError(f"{LORA_KEY}.alpha={self.alpha!r} must be > 0 (the adapter's output is scaled by "
                             "alpha/rank)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{LORA_KEY}.dropout={self.dropout!r} must be in [0, 1)")
        if not self.lr_scale > 0:
            raise ValueError(f"{LORA_KEY}.lr_scale={self.lr_scale!r} must be > 0 (LoRA lr = algorithm.lr x lr_scale)")
        targets, expected = self.target_modules, "'all-linear' or a list of module names, e.g. [q_proj,k_proj]"
        listed = isinstance(targets, Sequence) and not isinstance(targets, str)
        if isinstance(targets, str) and targets != "all-linear" or not isinstance(targets, str) and not listed:
            raise ConfigError([problem_line(f"{LORA_KEY}.target_modules", targets, expected)])
        if listed:
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ConfigError([problem_line(f"{LORA_KEY}.target_modules", list(targets), expected)])
            object.__setattr__(self, "target_modules", tuple(targets))
        # an option without a rank would be ignored: LoRA is off (full fine-tuning) until rank is set
        inert = [f"{LORA_KEY}.{f.name}" for f in fields(self)
                 if f.name != "rank" and getattr(self, f.name) != f.default]
        if self.rank is None and inert:
            raise ConfigError([f"{', '.join(inert)} set without {LORA_KEY}.rank: LoRA is off (all weights train) "
                               f"until {LORA_KEY}.rank=R is set (e.g. 16); set it, or leave {LORA_KEY} unset"])

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    def learning_rate(self, lr: float) -> float:
        """The optimizer's rate for `algorithm.lr`: x lr_scale with LoRA (the ~10x rule), as is without."""
        return lr * self.lr_scale if self.enabled else lr

    @classmethod
    def from_any(cls, value: Union[None, Mapping[str, Any], "LoraOptions"]) -> "LoraOptions":
        """None or {} = full fine-tuning; a mapping of the fields (unknown keys are refused, naming the valid ones)."""
        return value if isinstance(value, cls) else cls(**checked_fields(cls, value, LORA_KEY))

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_modules"] = self.target_modules if isinstance(self.target_modules, str) else list(
            self.target_modules)
        return out


MODEL_DTYPES = ("float32", "bfloat16", "float16")  # the trained weights' (lit_rlvr.models.load_policy)


@dataclass(frozen=True)
class ModelConfig:
    """The `model` group: `name_or_path` an HF path or hub name, or "tiny" (the built-in model, warm-started and
    cached, `options` its warm-up's settings); `dtype` of the trained weights; `chat_template`: prompts go through
    the tokenizer's chat template (instruct models); `compile`: the update's forward and backward through
    `torch.compile` (docs/mfu.md); `lora`: LoRA adapters instead of full fine-tuning (`LoraOptions`)."""

    name_or_path: str = setting("tiny", (lambda v: isinstance(v, str) and bool(v), "an HF path or hub name, or tiny"))
    dtype: str = setting("float32", one_of(MODEL_DTYPES))
    chat_template: bool = setting(False, BOOL)
    # the same update through compiled kernels (float order only): a resume may change it
    compile: bool = setting(False, (lambda v: isinstance(v, bool), "true or false"), on_resume=True)
    options: dict[str, Any] = setting(rule=MAPPING, factory=dict)
    lora: LoraOptions = setting(factory=LoraOptions)

    def __post_init__(self) -> None:
        check_fields(self, "model")
        object.__setattr__(self, "lora", LoraOptions.from_any(self.lora))  # a mapping of its fields, or None


@dataclass(frozen=True)
class RewardConfig:
    """The `reward` group: `name` a built-in reward (`lit_rlvr.rewards.REWARDS`) or "package.module:function";
    `options` the reward's and its runner's settings (docs/rewards.md)."""

    name: str = setting("arithmetic", (lambda v: isinstance(v, str) and bool(v) or callable(v),
                                       "a built-in reward's name, 'package.module:function', or a callable"))
    options: dict[str, Any] = setting(rule=MAPPING, factory=dict)

    def __post_init__(self) -> None:
        check_fields(self, "reward")


@dataclass(frozen=True)
class EngineConfig:
    """The `engine` group: `name` hf | sglang | vllm | vllm_server | sglang_server, `options` the engine's
    (docs/engines.md)."""

    name: str = setting("hf", one_of(("hf", "sglang", "vllm", "vllm_server", "sglang_server")))
    options: dict[str, Any] = setting(rule=MAPPING, factory=dict)

    def __post_init__(self) -> None:
        check_fields(self, "engine")


ROLLOUT_MODES = ("sync", "async")
STALE_STRATEGIES = ("wait", "drop")
KV_AT_SWAP = ("keep", "recompute")


@dataclass(frozen=True)
class RolloutConfig:
    """The `rollout` group: when generation runs (docs/async.md). `mode` sync: each step generates its batch, then
    updates; async: a producer generates the next batches while the trainer updates. `max_staleness` S: a
    completion generated by the weights of update v (versions count RL steps) trains update u only if u - v <= S
    (S = 0 is the synchronous run). `stale_strategy` wait: the producer runs S batches ahead, so nothing exceeds the
    bound; drop: it runs S + 1 ahead and a batch past the bound is evicted whole and generated again.
    `partial_rollout`: the trainer's push lands while a batch is being generated, and unfinished completions continue
    under the new weights (false: the push waits for the batch to end); `kv_at_swap` keep or recompute their KV
    cache at that swap."""

    mode: str = setting("sync", one_of(ROLLOUT_MODES))
    max_staleness: int = setting(1, (lambda v: _integer(v) and 0 <= v <= 64, "an integer in [0, 64] (policy "
                                                                              "versions)"))
    stale_strategy: str = setting("wait", one_of(STALE_STRATEGIES))
    partial_rollout: bool = setting(False, (lambda v: isinstance(v, bool), "true or false"))
    kv_at_swap: str = setting("keep", one_of(KV_AT_SWAP))

    def __post_init__(self) -> None:
        check_fields(self, "rollout")
        if self.mode == "async" and self.stale_strategy == "drop" and self.max_staleness == 0:
            raise ConfigError(["rollout.stale_strategy=drop with rollout.max_staleness=0: drop runs one batch ahead, "
                               "so every batch would arrive one version too stale and be generated twice; use "
                               "rollout.stale_strategy=wait (S = 0 then trains each batch as the synchronous run "
                               "does) or rollout.max_staleness >= 1"])

    @property
    def lead(self) -> int:
        """Batches the producer holds in flight ahead of the one being trained (0: synchronous)."""
        if self.mode == "sync":
            return 0
        return self.max_staleness + (self.stale_strategy == "drop")


@dataclass(frozen=True)
class EnvConfig:
    """The `env` group: multi-turn rollouts with an environment (`lit_rlvr.envs`; "none": single-turn);
    null limits take the environment class's defaults (docs/environments.md). `stop`: more strings that end a model
    turn, besides the environment class's own. `options`: the environment's (`reward`: null = the run's reward)."""

    name: str = setting("none", (lambda v: isinstance(v, (str, type)) and bool(v),
                                 "none, a built-in environment's name, or 'package.module:Class'"))
    max_turns: Optional[int] = setting(None, (lambda v: v is None or _integer(v) and v >= 1,
                                               "an integer >= 1 (model turns per rollout)"))
    max_tokens: Optional[int] = setting(None, (lambda v: v is None or _integer(v) and v >= 1,
                                               "an integer >= 1 (response tokens per rollout, model and observation "
                                               "tokens)"))
    timeout_s: Optional[float] = setting(None, (lambda v: v is None or _real(v) and math.isfinite(v) and v > 0,
                                                "a finite number of seconds > 0 (one environment call)"),
                                         on_resume=True)
    stop: list[str] = setting(rule=(lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v),
                                    "a list of non-empty strings (an empty one would end every model turn at its "
                                    "first token)"), factory=list)
    options: dict[str, Any] = setting(rule=(lambda v: isinstance(v, Mapping), "a mapping of the environment's "
                                                                               "options"), factory=dict)

    def __post_init__(self) -> None:
        check_fields(self, "env")


DATA_FORMATS = ("auto", "jsonl", "parquet", "hf")  # file formats of data.path (lit_rlvr.data.formats.load_records)
BAD_ROWS = ("error", "skip")
OPTIONAL_TEXT: Rule = optional(TEXT)
FIELDS: Rule = (lambda v: v is None or isinstance(v, (str, Mapping)), "a field preset's name or a mapping "
                "{prompt: COLUMN, answer: COLUMN}, or null")


@dataclass(frozen=True)
class DataConfig:
    """The `data` group: `RLVRDataModule`'s arguments (lit_rlvr.data.datamodule; its constructor's defaults are
    these, and its docstring says what each means). The defaults are the built-in task's, `python train.py`'s
    (conf/data/arithmetic.yaml). `answer_tokens`: about how many tokens a completion of this data needs (its
    working and its answer), when its config declares it: `algorithm.max_new_tokens` below it is refused before
    any work (`lit_rlvr.config.bounds.answer_budget_problems`), since completions cut short have no answer."""

    task: Optional[str] = setting("arithmetic", optional((lambda v: isinstance(v, str) and bool(v),
                                                          "a built-in task's name (or data.path for files)")))
    batch_size: int = setting(64, (lambda v: _integer(v) and v >= 1, "an integer >= 1 (prompts per RL step, all "
                                                                     "ranks together)"))
    eval_batch_size: int = setting(128, at_least(1), on_resume=True)
    seed: int = setting(0, SEED)
    split_seed: int = setting(0, at_least(0))
    levels: tuple[int, ...] = setting((2, 3, 4), (lambda v: isinstance(v, Sequence) and not isinstance(v, str)
                                                  and bool(v) and all(_integer(x) for x in v),
                                                  "a non-empty list of the task's levels (integers)"))
    num_train: int = setting(100_000, at_least(1))
    num_test: int = setting(256, at_least(1), on_resume=True)
    path: Optional[str] = setting(None, OPTIONAL_TEXT)
    eval_path: Optional[str] = setting(None, OPTIONAL_TEXT, on_resume=True)
    format: str = setting("auto", one_of(DATA_FORMATS))
    split: str = setting("train", TEXT)
    eval_split: str = setting("test", TEXT, on_resume=True)
    fields: Optional[Any] = setting(None, FIELDS)
    eval_fields: Optional[Any] = setting(None, FIELDS, on_resume=True)
    max_prompt_chars: Optional[int] = setting(None, optional(at_least(1)))
    max_prompt_tokens: Optional[int] = setting(None, optional(at_least(1)))
    on_bad_row: str = setting("error", one_of(BAD_ROWS))
    eval_limit: Optional[int] = setting(None, optional(at_least(1)), on_resume=True)
    instruction: Optional[str] = setting(None, optional((lambda v: isinstance(v, str), "a string")))
    system_prompt: Optional[str] = setting(None, optional((lambda v: isinstance(v, str), "a string")))
    answer_tokens: Optional[int] = setting(None, (lambda v: v is None or _integer(v) and v >= 1,
                                                  "an integer >= 1 (tokens a completion needs), or null"))

    def __post_init__(self) -> None:
        check_fields(self, "data")
        object.__setattr__(self, "levels", tuple(self.levels))
        if self.task is None and self.path is None:
            raise ConfigError(["data: set data.task (a built-in task) or data.path (a prompt file)"])


@dataclass(frozen=True)
class PerfConfig:
    """`perf`: `peak_flops` the device's peak FLOP/s that `perf/mfu_*` divide by, `peak_bandwidth` its memory
    bandwidth in bytes/s that `perf/mbu_gen` divides by (null: a CPU's is measured once and cached in `cache_dir`,
    a GPU's published; docs/mfu.md)."""

    peak_flops: Optional[float] = setting(None, (lambda v: v is None or _real(v) and v > 0,
                                                 "the device's peak FLOP/s, a number > 0 (e.g. 989.4e12: an H100 in "
                                                 "bf16), or null (a CPU's measured, a GPU's published; docs/mfu.md)"))
    cache_dir: Optional[str] = setting(None, optional(TEXT))
    peak_bandwidth: Optional[float] = setting(None, (lambda v: v is None or _real(v) and v > 0,
                                                     "the device's memory bandwidth in bytes/s, a number > 0 (e.g. "
                                                     "3.35e12: an H100 SXM), or null (a CPU's measured, a GPU's "
                                                     "published; docs/mfu.md)"))

    def __post_init__(self) -> None:
        check_fields(self, "perf")
