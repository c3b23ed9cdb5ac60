"""Checks for `resume=PATH` and `checkpoint=PATH`, run before any work (docs/architecture.md §10).

A checkpoint must be a readable lit-rlvr checkpoint (not truncated, not garbage), and a resumed run must mean
the same as the run that wrote it: the resolved config recorded in the checkpoint (`RunConfig` writes it) is
compared with this run's. Keys under `FROZEN` decide what the run computes (algorithm and optimizer, model,
group size, sampling, reward, data and its order, seed): a difference is refused, each one listed. Keys under
`MUTABLE` (inside a frozen section) and everything else (trainer.max_steps, loggers, callbacks, eval_before,
checkpoint_every, paths) may change. `resume_allow=[algorithm.lr]` accepts named differences deliberately
(a section name accepts all keys under it); they take effect and are recorded in the checkpoint's
`lit_rlvr_config.overrides`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterable, Optional

import lightning.pytorch as pl
from omegaconf import OmegaConf
from typing_extensions import override

from lit_rlvr.config.errors import CheckpointError
from lit_rlvr.config.schemas import SCHEMAS
from lit_rlvr.config.settings import resume_mutable

log = logging.getLogger(__name__)

CONFIG_KEY = "lit_rlvr_config"  # the checkpoint entry: {"config": resolved config, "overrides": [...]}
FROZEN = ("seed", "algorithm", "model", "engine", "reward", "data", "env", "rollout", "trainer.accelerator",
          "trainer.devices", "trainer.num_nodes", "trainer.precision", "trainer.strategy",
          "trainer.accumulate_grad_batches")


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists stay values."""
    if not isinstance(node, dict) or (prefix and not node):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


# keys inside the frozen sections that may change: the typed settings' fields marked so (`setting(on_resume=True)`:
# evaluation, memory knobs, the same update through compiled kernels, DAPO's cap that only stops a run), and of the
# mapping-valued sections: evaluation settings, memory knobs and paths
MUTABLE = (*(key for section, cls in SCHEMAS.items() for key in resume_mutable(cls, section)),
           "data.num_test", "data.eval_batch_size", "data.eval_limit", "data.eval_path", "data.eval_split",
           "data.eval_fields", "model.options.cache_dir", "engine.options.max_batch", "reward.options.isolation",
           "reward.options.timeout_s", "reward.options.workers",
           # where and in how much memory an engine runs, not what it samples (a resumed job gets other ports)
           "engine.options.base_port", "engine.options.port_stride", "engine.options.bucket_bytes",
           "engine.options.mem_fraction_static", "engine.options.server_args.max_total_tokens",
           "engine.options.gpu_memory_utilization", "engine.options.kv_cache_memory_bytes",
           "engine.options.sleep_level", "engine.options.enforce_eager",
           # the post-push check only watches (it never changes what is sampled)
           "engine.options.sync_check_tol", "engine.options.sync_check_every")
# a typed setting added after checkpoints were written without it: absent there means its default
ADDED_LATER = flatten({section: OmegaConf.to_container(OmegaConf.structured(cls)) for section, cls in SCHEMAS.items()})
# the loss variants were subclasses before they became options: a checkpoint that names one records the same run as
# GRPOModule with these settings (DAPO's refills: max_refill_batches after the first batch = generation batches - 1)
VARIANT_CLASSES = {"lit_rlvr.algorithms.DAPOModule": {}, "lit_rlvr.algorithms.DrGRPOModule": {"advantages": "dr_grpo"},
                   "lit_rlvr.algorithms.GSPOModule": {"policy_loss": "gspo"}}
# optimizer settings that a checkpoint's optimizer state would silently put back: applied after the restore
OPTIMIZER_KEYS = {"algorithm.lr": "lr", "algorithm.weight_decay": "weight_decay"}


def load_checkpoint(path: Path, key: str = "resume") -> dict[str, Any]:
    """The checkpoint at `path`, memory-mapped (tensors are read only when used), or a one-line `CheckpointError`
    for a truncated, corrupt or foreign file. Of a sharded checkpoint (a folder, one file per rank) only the
    metadata file is read: its tensors are checked by the strategy that loads them."""
    import torch

    sharded = path.is_dir()
    source = path / "meta.pt" if sharded else path  # Lightning's ModelParallelStrategy metadata file
    try:
        state = torch.load(source, map_location="cpu", weights_only=False, mmap=not sharded)
    except Exception as err:  # EOFError, UnpicklingError, zip and mmap errors: all mean "not a checkpoint"
        size = path.stat().st_size if path.exists() else 0
        reason = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{key}={str(path)!r}: not a readable checkpoint ({size} bytes; truncated or corrupt: "
                              f"{type(err).__name__}: {reason[:160]}); pass {key}= an intact checkpoint, e.g. "
                              "another run's checkpoints/last.ckpt") from None
    required = ("global_step",) if sharded else ("state_dict", "global_step")
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{key}={str(path)!r}: not a lit-rlvr checkpoint (no {', '.join(missing)}); pass "
                              f"{key}= a file that train.py wrote (checkpoints/last.ckpt)")
    return state


def resolved_config(cfg: Any) -> dict[str, Any]:
    """The run's config as plain containers, resolved section by section; a section that cannot be resolved here
    (e.g. a logger's `${hydra:...}` outside a Hydra run) is kept as written."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    for key in plain:
        try:
            node = cfg[key]
            plain[key] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        except Exception:  # omegaconf's interpolation errors have no common base class
            pass
    return plain


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) or a == b
    return a == b


def in_todays_keys(recorded: dict[str, Any]) -> dict[str, Any]:
    """A flat recorded config in the keys of today's configs (the variant classes of `VARIANT_CLASSES`, DAPO's
    `dynamic_sampling` and `max_refill_batches`); a config that names none of them comes back unchanged."""
    settings = VARIANT_CLASSES.get(recorded.get("algorithm._target_"))
    if settings is None:
        return recorded
    upgraded = {k: v for k, v in recorded.items() if k not in ("algorithm.dynamic_sampling",
                                                                "algorithm.max_refill_batches")}
    upgraded["algorithm._target_"] = "lit_rlvr.module.GRPOModule"
    upgraded.update({f"algorithm.{k}": v for k, v in settings.items()})
    if "algorithm.dynamic_sampling" in recorded:
        refills = recorded.get("algorithm.max_refill_batches")
        upgraded["algorithm.filter_groups.enable"] = bool(recorded["algorithm.dynamic_sampling"])
        upgraded["algorithm.filter_groups.metric"] = "acc"
        upgraded["algorithm.filter_groups.max_num_gen_batches"] = 0 if refills is None else int(refills) + 1
    return upgraded


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, this run's value) for each frozen key that differs; `<absent>` where missing."""
    old, new = in_todays_keys(flatten(saved)), flatten(current)
    diffs = []
    for key in sorted(set(old) | set(new)):
        if not _under(key, FROZEN) or _under(key, MUTABLE):
            continue
        a, b = old.get(key, ADDED_LATER.get(key, "<absent>")), new.get(key, "<absent>")
        if not _same(a, b):
            diffs.append((key, a, b))
    return diffs


def check_config(path: Path, state: dict[str, Any], current: dict[str, Any], allow: Iterable[str]) -> list[dict]:
    """Refuses (`CheckpointError`) frozen differences not in `allow`; returns the allowed ones as records."""
    recorded = state.get(CONFIG_KEY)
    if recorded is None:
        log.warning("resume=%s: the checkpoint records no config (written before lit-rlvr kept one); the run's "
                    "config cannot be compared with it", path)
        return []
    allow = list(allow)
    diffs = config_differences(recorded["config"], current)
    refused = [d for d in diffs if not _under(d[0], allow)]
    if refused:
        listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, a, b in refused)
        keys = ",".join(k for k, _, _ in refused)
        raise CheckpointError(f"resume={str(path)!r}: this run's config differs from the checkpoint's on keys that "
                              f"change what the run computes: {listed}. Use the checkpoint's values, start a new run "
                              f"(without resume=), or accept the change deliberately with resume_allow=[{keys}]")
    step = int(state.get("global_step", 0))
    for key, a, b in diffs:
        log.warning("resume=%s: %s changes from %r to %r at step %d (resume_allow)", path, key, a, b, step)
    return [{"key": k, "checkpoint": a, "new": b, "step": step} for k, a, b in diffs]


def check_weights_fit(path: Path, state: dict[str, Any], module: pl.LightningModule, key: str, model: str) -> None:
    """The checkpoint's policy tensors have this model's names and shapes (another model size is refused)."""
    if "state_dict" not in state:  # no resume, or a sharded checkpoint (its strategy checks the shards)
        return
    saved = state["state_dict"]
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items() if k.startswith("policy.")}
    missing = [k for k in ours if k not in saved]
    wrong = [(k, tuple(saved[k].shape), s) for k, s in ours.items() if k in saved and tuple(saved[k].shape) != s]
    if missing or wrong:
        what = (f"{len(wrong)} tensors differ in shape, e.g. {wrong[0][0]} is {list(wrong[0][1])} there and "
                f"{list(wrong[0][2])} here" if wrong else f"{len(missing)} tensors are missing, e.g. {missing[0]}")
        raise CheckpointError(f"{key}={str(path)!r}: the checkpoint's weights do not fit model={model!r} ({what}); "
                              f"pass {key}= a checkpoint of this model, or the model it was trained with")


class RunConfig(pl.Callback):
    """Records the resolved config (and the accepted `resume_allow` differences) and the optimizers' classes in
    every checkpoint, and applies accepted optimizer settings after Lightning has restored the optimizer (which
    would put the old ones back). A resume whose optimizer is not the checkpoint's (`resume_allow=[algorithm]`
    from a c3po run into a grpo one: IVON's state has no AdamW `betas`) starts with fresh optimizer state, and
    says so; the weights, data position, RNG and the lr schedule's step continue."""

    def __init__(self, config: dict[str, Any], overrides: Optional[list[dict]] = None):
        self.config, self.overrides = config, list(overrides or [])
        self._pending = [o for o in self.overrides if o["key"] in OPTIMIZER_KEYS]
        self._loaded: Optional[dict] = None  # the checkpoint being restored, until its optimizer state is checked
        self.fresh_optimizer = False

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._loaded = checkpoint
        if trainer.optimizers:  # a strategy that restores after its setup (FSDP2): the optimizers exist already
            self._check_optimizer_state(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_optimizer_state(trainer)  # after the optimizers are built, before Lightning restores them

    def _check_optimizer_state(self, trainer: pl.Trainer) -> None:
        checkpoint, self._loaded = self._loaded, None
        if checkpoint is None or not checkpoint.get("optimizer_states"):
            return
        why = optimizer_change(checkpoint, trainer.optimizers)
        if why is not None:
            log.warning("resume: %s; this run starts with fresh optimizer state (no moments%s), while the weights, "
                        "data position, RNG and step count continue from the checkpoint", why,
                        ", Hessian estimate or noise step" if any("IVON" in type(o).__name__
                                                                  for o in trainer.optimizers) else "")
            checkpoint["optimizer_states"] = []  # Lightning restores what is listed: nothing
            self.fresh_optimizer = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for record in self._pending:
            apply_optimizer_setting(trainer, OPTIMIZER_KEYS[record["key"]], float(record["new"]))
        self._pending = []

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[CONFIG_KEY] = {"config": self.config, "overrides": self.overrides,
                                  "optimizers": [type(o).__qualname__ for o in trainer.optimizers]}


def optimizer_change(checkpoint: dict, optimizers: list) -> Optional[str]:
    """Why the checkpoint's optimizer state cannot be loaded into `optimizers`, or None when it can: another
    optimizer class (recorded in the checkpoint; before that record: `algorithm.optimizer` of its config), or
    other param groups."""
    recorded = checkpoint.get(CONFIG_KEY) or {}
    ours = [type(o).__qualname__ for o in optimizers]
    theirs = recorded.get("optimizers")
    if theirs is None and "config" in recorded:
        saved = (recorded["config"].get("algorithm") or {}).get("optimizer", "adamw")
        current = "ivon" if any("IVON" in name for name in ours) else "adamw"
        theirs = ours if saved == current else [f"{saved} (algorithm.optimizer)"]
    if theirs is not None and theirs != ours:
        return f"the checkpoint's optimizer is {', '.join(theirs)}, this run's is {', '.join(ours)}"
    states = checkpoint["optimizer_states"]
    shapes = [[len(g["params"]) for g in s["param_groups"]] for s in states]
    if shapes != [[len(g["params"]) for g in o.param_groups] for o in optimizers]:
        return f"the checkpoint's optimizer has other parameter groups ({shapes})"
    return None


def apply_optimizer_setting(trainer: pl.Trainer, name: str, value: float) -> None:
    """Sets `name` (lr, weight_decay) in every param group. For lr, scales the schedulers' base values too, so a
    warm-up or decay schedule continues from the new base value."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            if name == "lr" and group.get("initial_lr"):
                ratio = value / group["initial_lr"]
                group["lr"], group["initial_lr"] = group["lr"] * ratio, value
            else:
                group[name] = value
    if name == "lr":
        for config in trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [value for _ in config.scheduler.base_lrs]
