"""The `python train.py` recipe as plain functions over a Hydra config: build, evaluate, train, summarise."""

from __future__ import annotations

import csv
import functools
import inspect
import io
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_rlvr.config.arguments import build
from lit_rlvr.app.config_check import env_arguments
from lit_rlvr.config.errors import ConfigError, DataError, StopRequested
from lit_rlvr.config.options import problem_line
from lit_rlvr.config.settings import AlgorithmConfig, RolloutConfig
from lit_rlvr.data.formats import render_prompt
from lit_rlvr.hooks import check_rl_callbacks
from lit_rlvr.models.lora import is_adapter_dir, load_adapter_weights, options_from_adapter
from lit_rlvr.module import GRPOModule
from lit_rlvr.run import jsonsafe
from lit_rlvr.run.one_line import config_phase
from lit_rlvr.run.processes import peak_rss_mb
from lit_rlvr.run.resume import RunConfig, check_config, check_weights_fit, load_checkpoint, resolved_config
from lit_rlvr.run.run_checkpoint import STOP_GRACE_S, RunCheckpoint
from lit_rlvr.run.stop import STOP, stop_requests
from lit_rlvr.run.storage import write_atomic
from lit_rlvr.strategies import FSDP2Strategy

log = logging.getLogger(__name__)

# Lightning's advice for manually optimized modules does not apply: an RL step saves after its update
warnings.filterwarnings("ignore", message=".*Using ModelCheckpoint with manual optimization.*")
# validation metrics are torchmetrics objects, already reduced over ranks when they are logged
warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")

SUMMARY_FILE = "summary.json"


def module_arguments(cfg: DictConfig) -> dict[str, Any]:
    """The module's arguments from the composed config: the class (`algorithm._target_`: GRPOModule or a subclass)
    and one mapping per settings group, with the same nested names (lit_rlvr.config.settings). A `???` value of
    `env` is left out, so the environment's own check names what it needs (env=skyrl: `env.options.id`)."""
    algorithm = OmegaConf.to_container(cfg.algorithm, resolve=True)
    for key in ("name", "callbacks"):
        algorithm.pop(key, None)
    env = env_arguments(cfg)
    target = algorithm.pop("_target_")
    # a subclass's own arguments (docs/write_your_own_loss.md) are keys of the algorithm group too
    try:
        own = set(inspect.signature(get_class(target).__init__).parameters)
    except Exception:  # noqa: BLE001 - a bad `_target_` is named by `_instantiate`, which imports it again
        own = set()
    own -= set(inspect.signature(GRPOModule.__init__).parameters)
    extra = {key: algorithm.pop(key) for key in list(algorithm) if key in own}
    return {"_target_": target, **extra, "algorithm": algorithm,
            "model": OmegaConf.to_container(cfg.model, resolve=True),
            "reward": OmegaConf.to_container(cfg.reward, resolve=True),
            "engine": OmegaConf.to_container(cfg.engine, resolve=True),
            "env": {"name": env.get("env", "none"), **env.get("env_options", {})},
            "perf": OmegaConf.to_container(cfg.perf, resolve=True) if cfg.get("perf") is not None else None,
            "rollout": OmegaConf.to_container(cfg.rollout, resolve=True) if cfg.get("rollout") is not None else None,
            "seed": cfg.seed}


def build_module(cfg: DictConfig) -> GRPOModule:
    """The algorithm's module with the model, reward, engine and environment settings and the run seed."""
    return _instantiate(module_arguments(cfg), _convert_="all")


def _instantiate(node: Any, **kwargs: Any) -> Any:
    """hydra's instantiate, but a config error raised by our classes (a check's ValueError, FileNotFoundError or
    ImportError, a KeyError) reaches the user as itself, not wrapped in Hydra's `InstantiationException`, and a
    value left `???` is one line naming it (its key as the constructor's argument) rather than OmegaConf's error."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (*config_phase.KINDS, KeyError)):
            raise err.__cause__ from None
        raise
    except MissingMandatoryValue as err:
        raise ConfigError([problem_line(str(err.full_key), "???", "a value (set it in the config or as an override)")]
                          ) from None


def _keyed(section: Optional[DictConfig]) -> list[Any]:
    """Instantiate every non-null entry of a keyed dict (callbacks, loggers)."""
    if not section:
        return []
    return [_instantiate(node) for node in section.values() if node is not None]


def build_trainer(cfg: DictConfig, run_dir: Path, resume_overrides: Optional[list] = None) -> pl.Trainer:
    checkpoint = RunCheckpoint(run_dir / "checkpoints", every_n_steps=cfg.checkpoint_every,
                               stop_grace_s=cfg.get("stop_grace_s", STOP_GRACE_S))
    run_config = RunConfig(resolved_config(cfg), resume_overrides)  # recorded in checkpoints
    callbacks = [checkpoint, run_config, *_keyed(cfg.get("callbacks")), *_keyed(cfg.algorithm.get("callbacks"))]
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_kwargs["enable_checkpointing"] = False  # RunCheckpoint writes last.ckpt (no default ModelCheckpoint)
    strategy = trainer_kwargs.pop("strategy", "auto")
    if isinstance(strategy, dict):
        strategy = instantiate(strategy)
    return pl.Trainer(**trainer_kwargs, strategy=strategy, callbacks=callbacks, logger=_keyed(cfg.get("logger")),
                      default_root_dir=str(run_dir))


def validate(trainer: pl.Trainer, module: GRPOModule, datamodule, ckpt_path: Optional[str] = None) -> dict[str, float]:
    results = trainer.validate(module, datamodule=datamodule, verbose=False, ckpt_path=ckpt_path, weights_only=False)
    return {k: float(v) for k, v in (results[0] if results else {}).items()}


def _load_data(datamodule: pl.LightningDataModule, trainer: pl.Trainer, stage: str) -> None:
    """Reads the data now, so a bad file or row fails before the model loads (fit/validate reuse it)."""
    datamodule.trainer = trainer  # as Lightning would attach it (a setup may ask for the rank)
    try:
        datamodule.setup(stage)
    except DataError as err:
        raise DataError(f"{err}\nAs train.py overrides: data.fields.prompt=COLUMN data.fields.answer=COLUMN "
                        "(or data.fields=PRESET), data.on_bad_row=skip") from None


def _check_prompt_tokens(datamodule: pl.LightningDataModule, module: GRPOModule) -> None:
    """File prompts fit the model's context (minus the response budget: algorithm.max_new_tokens, env.max_tokens
    with an environment), counted with the module's own rendering."""
    check = getattr(datamodule, "check_prompt_tokens", None)
    if check is not None:
        budget, key = module.response_budget
        render = functools.partial(render_prompt, tokenizer=module.tokenizer,
                                   chat_template=module.settings.model.chat_template)  # as the module's plans
        check(render, lambda text: module.tokenizer(text, add_special_tokens=False)["input_ids"],
              module.context, budget, key)


def check_run_dir(hydra_cfg: DictConfig) -> None:
    """A multi-process run (torchrun, srun) needs one run dir on every rank. The default `hydra.run.dir` holds
    `${now:…}`, which each rank resolves on its own clock: ranks that start in different seconds would write
    their checkpoints and logs to different dirs. Refused before any work."""
    ranks = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    run_dir = str(OmegaConf.to_container(hydra_cfg.run, resolve=False)["dir"])
    if ranks > 1 and "${now:" in run_dir:
        raise ValueError(f"hydra.run.dir={run_dir!r} depends on the clock, which each of the {ranks} ranks reads "
                         f"for itself; set hydra.run.dir=DIR (the same on every rank) for a multi-process run")


def _check_resume(path: Path) -> None:
    """`resume=PATH` must exist; a save interrupted between its two renames (a sharded checkpoint is a folder:
    `RunCheckpoint` moves the old one aside first) leaves the previous checkpoint as PATH.old: say so."""
    if path.exists():
        return
    aside = path.with_name(path.name + RunCheckpoint.ASIDE)
    hint = (f"; {aside} holds the checkpoint before an interrupted save: rename it to {path.name} to resume from it"
            if aside.exists() else " (a run keeps its checkpoints/last.ckpt)")
    raise FileNotFoundError(f"resume={str(path)!r}: no such checkpoint{hint}")


def _build_run(cfg: DictConfig, run_dir: Path) -> tuple[pl.LightningDataModule, pl.Trainer, GRPOModule]:
    """Data, trainer and module of a training run, every check passed; before any work, so a ValueError,
    FileNotFoundError or ImportError raised here is a config error (one line from the entry points)."""
    with config_phase():
        resumed, overrides = {}, []
        if cfg.resume is not None:  # checked before any work: nothing in the run dir is touched by a refused resume
            _check_resume(Path(cfg.resume))
            resumed = load_checkpoint(Path(cfg.resume))
            allow = list(cfg.get("resume_allow") or [])
            overrides = check_config(Path(cfg.resume), resumed, resolved_config(cfg), allow)
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        datamodule = _instantiate(cfg.data)
        trainer = build_trainer(cfg, run_dir, overrides)
        arguments = module_arguments(cfg)
        algorithm = build(AlgorithmConfig, arguments["algorithm"], "algorithm")
        check_rl_callbacks(trainer.callbacks, algorithm, build(RolloutConfig, arguments["rollout"], "rollout"))
        _load_data(datamodule, trainer, "fit")
        module = build_module(cfg)
        _check_prompt_tokens(datamodule, module)
        check_weights_fit(Path(str(cfg.resume)), resumed, module, "resume", cfg.model.name_or_path)
    return datamodule, trainer, module


def _evaluate_before(trainer: pl.Trainer, module: GRPOModule, datamodule,
                     grace_s: float) -> tuple[dict[str, float], Optional[str]]:
    """The evaluation before training, under the stop requests of the one after it: a SIGTERM or a first Ctrl-C
    during it ends it within `grace_s` (generation checks) and the run stops before training. (Lightning's own
    SIGTERM flag is set during `validate` but cleared when `fit` starts: the run trained to the end.) Returns the
    metrics ({} when given up) and the signal's name, or None."""
    try:
        with stop_requests(grace_s if trainer.world_size == 1 else None):
            metrics = validate(trainer, module, datamodule)
            return metrics, (STOP.name or None) if STOP.requested and trainer.world_size == 1 else None
    except StopRequested as err:
        return {}, err.signal_name


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Evaluate, train, evaluate again; write summary.json; return the summary."""
    started = time.perf_counter()
    datamodule, trainer, module = _build_run(cfg, run_dir)
    checkpoint = next(cb for cb in trainer.callbacks if isinstance(cb, RunCheckpoint))
    before, stopped_before = ({}, None) if not cfg.eval_before or cfg.resume is not None else _evaluate_before(
        trainer, module, datamodule, checkpoint.stop_grace_s)
    if cfg.resume is not None:
        if trainer.is_global_zero:  # rank 0 writes metrics.csv; another rank here would race its logger
            _set_metrics_aside(run_dir)
    abandoned: Optional[StopRequested] = None
    try:
        if stopped_before:  # a stop during the evaluation before training: nothing trained, nothing to save
            checkpoint.stopped_by_sigterm, checkpoint.stopped_by_sigint = (stopped_before == "SIGTERM",
                                                                           stopped_before == "SIGINT")
            log.warning("stopped by %s during the evaluation before training: nothing was trained (run again to "
                        "train)", stopped_before)
        else:  # weights_only=False: our own checkpoints hold the config (omegaconf), RNG and data states
            trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.resume, weights_only=False)
    except SIGTERMException:  # Lightning exits (code 0) once the step that saw SIGTERM has ended
        if trainer.global_step == 0 and checkpoint.saved_step < 0:  # nothing saved (async: a filling call saves)
            raise
        checkpoint.stopped_by_sigterm = True
    except StopRequested as err:  # a step that did not end within stop_grace_s of the signal: nothing of it is kept
        abandoned = err
        checkpoint.stopped_by_sigterm, checkpoint.stopped_by_sigint = (err.signal_name == "SIGTERM",
                                                                       err.signal_name == "SIGINT")
    except BaseException:
        if trainer.is_global_zero:  # a failed run keeps the rows it had before the resume in metrics.csv
            _merge_metrics_aside(run_dir)
        raise
    if abandoned is not None:
        _say_abandoned(abandoned, checkpoint, module)
        after = {}
    elif stopped_before:
        after = {}
    elif checkpoint.stopped_by_sigterm or checkpoint.stopped_by_sigint:  # leave quickly: a grace period is short
        checkpoint.save(trainer)  # no-op when fit ended on a saved step (SIGTERM)
        log.warning("stopped by a signal at step %d; continue with resume=%s", module.global_step, checkpoint.last_path)
        after = {}
    else:
        if module.global_step == 0:  # e.g. async: the epochs held no more batches than the producer keeps ahead
            log.warning("training ended without an update: the data gave %d training batch(es)%s; raise "
                        "trainer.max_epochs or set trainer.max_steps", trainer.fit_loop.epoch_loop.batch_progress.
                        total.ready, f", and rollout.mode=async keeps {module.settings.rollout.lead} ahead of the "
                        "update" if module.settings.rollout.lead else "")
        checkpoint.save(trainer)  # no-op when fit ended on a saved step (max_steps)
        count_the_saved_step(trainer)
        try:
            with stop_requests(checkpoint.stop_grace_s if trainer.world_size == 1 else None):
                after = validate(trainer, module, datamodule)
        except StopRequested as err:  # the training is saved; only the evaluation after it is given up
            checkpoint.stopped_by_sigterm, checkpoint.stopped_by_sigint = (err.signal_name == "SIGTERM",
                                                                           err.signal_name == "SIGINT")
            log.warning("stopped: %s; the evaluation after training is given up; %s holds the trained run", err,
                        checkpoint.last_path)
            after = {}
    if trainer.is_global_zero:  # after its logger's last write (another rank may finish first)
        _merge_metrics_aside(run_dir)
    summary = summarise(cfg, run_dir, module, before, after, time.perf_counter() - started)
    summary["stopped_by_sigterm"] = checkpoint.stopped_by_sigterm
    summary["stopped_by_sigint"] = checkpoint.stopped_by_sigint
    stats = getattr(datamodule, "load_stats", {}).values()  # file data: rows dropped by on_bad_row=skip
    summary["data_rows_skipped"] = sum(s["skipped"] for s in stats)
    if trainer.is_global_zero:
        write_atomic(run_dir / SUMMARY_FILE, jsonsafe.dumps(summary, indent=2), "the run summary")  # NaN -> null
    return summary


def _say_abandoned(err: StopRequested, checkpoint: RunCheckpoint, module: GRPOModule) -> None:
    """One line: the step given up, and what a resume starts from (the last save, never the step's half-made state)."""
    if checkpoint.saved_step >= 0 and checkpoint.last_path.exists():
        where = (f"{checkpoint.last_path} holds step {checkpoint.saved_step} (saved every checkpoint_every="
                 f"{checkpoint.every_n_steps} steps); continue with resume={checkpoint.last_path}")
    else:
        where = f"no checkpoint was saved before it (checkpoint_every={checkpoint.every_n_steps}): nothing to resume"
    log.warning("stopped: %s (step %d); %s", err, module.global_step + 1, where)


METRICS_FILE, METRICS_ASIDE = "metrics.csv", "metrics.before_resume.csv"


def _read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _write_rows(path: Path, rows: list[dict[str, str]]) -> None:
    keys = sorted(set().union(*rows)) if rows else []
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, text.getvalue(), "the metrics file")


def _merged(old: list[dict[str, str]], new: list[dict[str, str]]) -> list[dict[str, str]]:
    """`old` rows before the first step of `new` (later ones were recomputed after the resume), then `new`."""
    steps = [int(r["step"]) for r in new if r.get("step")]
    first = min(steps) if steps else float("inf")
    return [r for r in old if r.get("step") and int(r["step"]) < first] + new


def _set_metrics_aside(run_dir: Path) -> None:
    """A CSVLogger deletes an existing metrics.csv; resuming into the same run dir keeps its rows aside
    (merged with any left by an earlier resume that did not finish) and merges them back at the end."""
    current, aside = run_dir / METRICS_FILE, run_dir / METRICS_ASIDE
    if current.exists():
        _write_rows(aside, _merged(_read_rows(aside), _read_rows(current)))
        current.unlink()


def _merge_metrics_aside(run_dir: Path) -> None:
    current, aside = run_dir / METRICS_FILE, run_dir / METRICS_ASIDE
    if aside.exists():
        _write_rows(current, _merged(_read_rows(aside), _read_rows(current)))
        aside.unlink()


def evaluate(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """`mode=eval checkpoint=PATH`: held-out metrics of a checkpoint, written to eval.json."""
    if cfg.checkpoint and is_adapter_dir(cfg.checkpoint):
        return evaluate_adapter(cfg, run_dir)
    datamodule, trainer, module, state = _build_eval(cfg, run_dir)
    sharded = Path(cfg.checkpoint).is_dir()  # trainer.strategy.save_distributed_checkpoint=true: a shard per rank
    if sharded:  # the strategy reads each rank's shards straight into the sharded policy
        metrics = validate(trainer, module, datamodule, ckpt_path=str(cfg.checkpoint))
    else:
        # mmap: only the tensors loaded are read from disk, never the optimizer's states (2-3x the weights)
        module.load_state_dict(state["state_dict"], strict=False)  # a reference model may differ
        metrics = validate(trainer, module, datamodule)
    return _write_eval(cfg, run_dir, trainer, module, datamodule, metrics)


def _write_eval(cfg: DictConfig, run_dir: Path, trainer: pl.Trainer, module: GRPOModule, datamodule: Any,
                metrics: dict[str, Any]) -> dict[str, Any]:
    """eval.json: the checkpoint, what was evaluated and how, and the metrics (written whole or not at all)."""
    result = {"checkpoint": str(cfg.checkpoint), "prompts": len(getattr(datamodule, "eval_set", None) or []),
              "samples_per_prompt": cfg.algorithm.eval_samples, "temperature": module.sampling.eval_temperature,
              **metrics}
    if trainer.is_global_zero:
        write_atomic(run_dir / "eval.json", jsonsafe.dumps(result, indent=2), "the evaluation result")
    return result


def evaluate_adapter(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """`mode=eval checkpoint=DIR` where DIR holds a LoRA adapter in PEFT's format (a run's checkpoints/adapter):
    the base model of `model.name_or_path` with that adapter (its rank, alpha and targets from its config)."""
    directory = Path(cfg.checkpoint)
    with config_phase():  # as _build_eval: a bad adapter, config or data is one line
        options = options_from_adapter(directory)
        cfg = cfg.copy()
        with open_dict(cfg):
            for key, value in options.as_dict().items():  # field by field: the node is typed (LoraOptions)
                cfg.model.lora[key] = value
        datamodule = _instantiate(cfg.data)
        trainer = build_trainer(cfg, run_dir)
        _load_data(datamodule, trainer, "validate")
        module = build_module(cfg)
        _check_prompt_tokens(datamodule, module)
        load_adapter_weights(module.policy, directory)
    return _write_eval(cfg, run_dir, trainer, module, datamodule, validate(trainer, module, datamodule))


def _build_eval(cfg: DictConfig, run_dir: Path) -> tuple[Any, pl.Trainer, GRPOModule, dict[str, Any]]:
    """Data, trainer, module and checkpoint state of `mode=eval`, every check passed (config errors: one line)."""
    with config_phase():
        if not cfg.checkpoint or not Path(cfg.checkpoint).exists():
            raise FileNotFoundError(f"checkpoint={cfg.checkpoint!r}: mode=eval needs an existing checkpoint file")
        state = load_checkpoint(Path(cfg.checkpoint), "checkpoint")  # a corrupt file fails before any work
        datamodule = _instantiate(cfg.data)
        trainer = build_trainer(cfg, run_dir)
        sharded = Path(cfg.checkpoint).is_dir()  # save_distributed_checkpoint=true: a shard per rank
        if sharded and not isinstance(trainer.strategy, FSDP2Strategy):
            raise ValueError(f"checkpoint={cfg.checkpoint!r} is a sharded checkpoint (a folder, one file per rank): "
                             "evaluate it with the FSDP trainer that wrote it, e.g. torchrun --nproc_per_node N "
                             "train.py mode=eval checkpoint=... trainer=fsdp32 (the run's trainer, model and engine)")
        _load_data(datamodule, trainer, "validate")
        module = build_module(cfg)
        _check_prompt_tokens(datamodule, module)
        if not sharded:
            check_weights_fit(Path(cfg.checkpoint), state, module, "checkpoint", cfg.model.name_or_path)
    return datamodule, trainer, module, state


def _reward_means(metrics_csv: Path) -> list[float]:
    if not metrics_csv.exists():
        return []
    with metrics_csv.open() as handle:
        return [float(row["reward/mean"]) for row in csv.DictReader(handle) if row.get("reward/mean")]


def count_the_saved_step(trainer) -> None:
    """A checkpoint saved at a batch's end holds that step as not yet counted; Lightning counts it when the resumed
    loop starts. A resume already at `max_steps` never starts the loop: count it here, or the evaluation after
    training is logged one step early and the summary has one step too few."""
    loop = trainer.fit_loop.epoch_loop
    total = loop.batch_progress.total
    if trainer.fit_loop.restarting and total.completed == total.processed - 1:
        loop._batches_that_stepped += 1
        total.completed += 1


def summarise(cfg, run_dir: Path, module: GRPOModule, before, after, wall_s: float) -> dict[str, Any]:
    """The run's summary.json (a collective under several ranks: the counters are summed over them)."""
    counters = module.counters.global_values()
    rewards = _reward_means(run_dir / "metrics.csv")
    first = rewards[: max(1, len(rewards) // 10)]
    last = rewards[-max(1, len(rewards) // 10) :]
    return {
        "algorithm": cfg.algorithm.name,
        "steps": module.trainer.fit_loop.epoch_loop._batches_that_stepped,  # RL steps: metrics.csv's `step`
        "optimizer_steps": module.global_step,  # what trainer.max_steps counts (more with mini_batches, ppo_epochs)
        "wall_s": round(wall_s, 2),
        "accuracy_before": before.get("val/accuracy", math.nan),
        "accuracy_after": after.get("val/accuracy", math.nan),
        "pass_at_k_after": after.get("val/pass@k", math.nan),
        "reward_mean_first": sum(first) / len(first) if rewards else math.nan,
        "reward_mean_last": sum(last) / len(last) if rewards else math.nan,
        "rollouts_total": counters["rollouts_total"],
        "tokens_generated": counters["tokens_generated"],
        "skipped_steps": counters["skipped_steps"],
        "reward_failures": counters["reward_failures"],
        "peak_rss_mb": peak_rss_mb(),
        "seed": cfg.seed,
        "run_dir": str(run_dir),
    }


def print_summary(summary: dict[str, Any], title: str = "lit-rlvr run") -> None:
    from lightning.pytorch.utilities import rank_zero_only
    from rich.console import Console
    from rich.table import Table

    if rank_zero_only.rank != 0:  # one table per run, not one per rank
        return

    table = Table(title=title)
    table.add_column("key")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
