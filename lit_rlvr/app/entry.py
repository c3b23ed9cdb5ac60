"""The Hydra recipe's entry: `python train.py` in a clone and `lit-rlvr-train` after `pip install` run `run`.

`lit-rlvr-train` reads the configs shipped in the package (`lit_rlvr.conf`, the clone's `conf/` folder), so it
works from any directory; overrides are the same as train.py's. Config errors (a wrong type or an unknown key,
which Hydra itself refuses while composing the typed settings: `check_command_line`; a value out of range, a
missing file named by a key, a constructor's check) and files that cannot be written (a full disk, a read-only
directory) print one line and exit with code 2 (lit_rlvr/run/one_line.py); LIT_RLVR_DEBUG=1 shows the
traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import hydra
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lit_rlvr.app.config_check import check_config
from lit_rlvr.app.hydra_checks import resume_setting
from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.problems import secret_problems, unknown_key_problems
from lit_rlvr.config.schemas import composition_problem, missing_key
from lit_rlvr.app.recipe import check_run_dir, evaluate, print_summary, train
from lit_rlvr.run import quiet
from lit_rlvr.run.distributed import shutdown
from lit_rlvr.run.one_line import config_phase, one_line_errors
from lit_rlvr.run.run_lock import hold_run_dir


def run(cfg: DictConfig) -> None:
    """Check the config, then train or evaluate as `cfg.mode` says."""
    with one_line_errors():
        _run(cfg)


def _run(cfg: DictConfig) -> None:
    with config_phase():
        check_config(cfg)
        check_run_dir(HydraConfig.get())
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with config_phase():  # (held already where conf/config.yaml's `RunDirCheck` ran)
        hold_run_dir(run_dir, "hydra.run.dir" if HydraConfig.get().mode == RunMode.RUN else "hydra.sweep.dir",
                     *resume_setting(cfg))
    quiet.install()
    if cfg.mode == "train":
        summary = train(cfg, run_dir)
        print_summary(summary, f"lit-rlvr {cfg.algorithm.name} run ({run_dir})")
    else:
        summary = evaluate(cfg, run_dir)
        print_summary(summary, f"lit-rlvr eval ({run_dir})")
    shutdown()  # torchrun: close the process group before exit
    if summary.get("stopped_by_sigterm") or summary.get("stopped_by_sigint"):
        # a stop request ends the process, not only this job: a sweep (-m) would start its next one (Hydra's
        # launcher catches a job's Exception, not SystemExit)
        raise SystemExit(0)


def compose_checked(config_dir: Optional[str], overrides: Sequence[str], config_name: str = "config") -> DictConfig:
    """The config `train.py` composes from `config_dir` (None: the package's, `lit_rlvr.conf`) and `overrides`. A value
    of the wrong type or an unknown key under a typed group (lit_rlvr/config/schemas.py), which Hydra refuses in
    several lines, is a `ConfigError` line instead; each such override is set aside and the rest composed again, so
    one `ConfigError` lists them all, with `check_config`'s lines for the rest. An override of a key the composed
    group lacks (`data=jsonl data.num_test=2`, `trainer.max_stepz=1`) is one line naming the group's keys."""
    problems, rest, unknown = [], list(overrides), []
    while True:
        try:
            with (initialize_config_dir(config_dir, version_base="1.3") if config_dir else
                  initialize_config_module("lit_rlvr.conf", version_base="1.3")):
                cfg = compose(config_name, overrides=rest)
            break
        except ConfigCompositionException as err:
            found = composition_problem(err)
            if found is None and missing_key(err) is not None:
                unknown.append(missing_key(err))
                found = ("", unknown[-1])  # its line once the rest is composed: the section's keys
            if found is None:
                raise
            problems += [found[0]] if found[0] else []
            kept = [o for o in rest if o.lstrip("~+").split("=", 1)[0] != found[1]]
            if len(kept) == len(rest):  # a config file's value, not an override
                raise ConfigError(problems or [f"{found[1]}: {err}"]) from None
            rest = kept
    problems += [line for key in unknown for line in _unknown_lines(cfg, key)]
    if problems:
        try:
            check_config(cfg)
        except ConfigError as err:
            problems += err.problems
        raise ConfigError(problems)
    return cfg


def _unknown_lines(cfg: DictConfig, key: str) -> list[str]:
    """The line for an override of `key`, which the composed `cfg` lacks: its section's keys, a close match."""
    section, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, section) if section else cfg
    valid = [str(k) for k in node.keys() if not str(k).startswith("_")] if isinstance(node, DictConfig) else []
    return unknown_key_problems(section, [name], valid) or [f"{key} is not an option"]


def check_command_line(config_dir: Optional[str] = None, argv: Optional[Sequence[str]] = None) -> None:
    """Before Hydra composes the command line's config: what the typed settings refuse is one line each (exit 2),
    as every other config error (`compose_checked`); what else Hydra refuses (an unknown config name) it reports
    itself. A setting named like a secret (an API key) is refused here, before Hydra records the command line in the
run's folder. Help, multirun sweeps and other config folders go to Hydra unchecked."""
    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if (args.help or args.hydra_help or args.info or args.shell_completion or args.multirun or args.config_path
            or args.experimental_rerun):
        return
    overrides = list(args.overrides)
    if args.config_dir:  # a folder of the user's configs, searched beside the package's (Hydra's --config-dir)
        overrides.append(f"hydra.searchpath=[file://{Path(args.config_dir).absolute()}]")
    with one_line_errors():
        ConfigError.check(unparsable_overrides(overrides))
        try:
            cfg = compose_checked(config_dir, overrides, args.config_name or "config")
        except ConfigError:
            raise
        except Exception:  # Hydra's own errors: it reports them when it composes
            return
        # before Hydra writes the command line and the config into the run's folder
        ConfigError.check(secret_problems(OmegaConf.to_container(cfg, resolve=False)))


def unparsable_overrides(overrides: Sequence[str]) -> list[str]:
    """A line per override Hydra's grammar cannot read (Hydra says so in four lines, naming no override): most often
    a value with `=`, `?`, `&` or spaces that is not quoted."""
    parser = OverridesParser.create()
    problems = []
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException as err:  # the value is not repeated: it may hold what the line should not show
            key = override.split("=", 1)[0].lstrip("~+")
            problems.append(f"the override of {key} cannot be read ({str(err).splitlines()[0]}): quote a value with "
                            f"=, ?, &, spaces or brackets, e.g. '{key}=\"...\"'")
    return problems


@hydra.main(config_path="pkg://lit_rlvr.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Console script `lit-rlvr-train [overrides]`."""
    run(cfg)


def console() -> None:
    """`lit-rlvr-train`: like `python -m`, the current directory is importable (reward.name=my_module:fn)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    check_command_line()
    main()


if __name__ == "__main__":
    check_command_line()
    main()
