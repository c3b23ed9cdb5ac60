"""`lit-rlvr`: the Lightning CLI over `GRPOModule` (and its subclasses) and `RLVRDataModule`.

    lit-rlvr fit --config conf/cli/tiny_grpo.yaml [--trainer.max_steps 5] [--ckpt_path last.ckpt]
    lit-rlvr validate --config conf/cli/tiny_grpo.yaml --ckpt_path outputs/cli/tiny_grpo/checkpoints/last.ckpt

The model is chosen in subclass mode (`model: {class_path: ..., init_args: ...}`): GRPOModule, whose `policy_loss`,
`advantages` and `filter_groups` give GSPO, Dr. GRPO and DAPO, or a subclass by import path (`my_losses.MyModule`).
Choose it in the config file: `--model X` given after `--config` keeps the init_args the config resolved,
including the first class's defaults (jsonargparse issue #460). `seed_everything` also
seeds the module's sampling and the data order, as `seed=` does for train.py. Hydra's `train.py` is the
recipe with before/after evaluation and summary.json; this entry is plain Lightning.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_rlvr.config.arguments import GROUPS
from lit_rlvr.config.errors import ConfigError, debug
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.module import GRPOModule
from lit_rlvr.run.checkpoint_io import AtomicCheckpointIO
from lit_rlvr.run.one_line import config_phase, one_line_errors, rename_keys, root_cause
from lit_rlvr.run.run_lock import hold_run_dir
from lit_rlvr.run.storage import check_writable_dir


# the module's arguments are train.py's config groups: a key is the same under one prefix (`algorithm.lr` is
# `model.init_args.algorithm.lr`)
CLI_KEYS = {f"{group}.": f"model.init_args.{group}." for group in GROUPS}
CLI_KEYS["model.init_args."] = "model.init_args."  # a key already in the CLI's names stays as it is


def cli_keys(line: str) -> str:
    """A check's message with train.py's key names (`algorithm.group_size`) as this CLI's
    (`model.init_args.algorithm.group_size`)."""
    return rename_keys(line, CLI_KEYS)


def parse_error_line(message: str) -> str:
    """jsonargparse's nested report of a value the parser refused (a type it does not convert to, an unknown key) as
    one line naming the CLI's key: the innermost refusal under the deepest `Parser key`, its value and what was
    expected."""
    stack: list[tuple[int, str]] = []
    best: tuple[int, list[str], str] = (-1, [], message.strip().splitlines()[0] if message.strip() else message)
    for raw in message.splitlines():
        indent, line = len(raw) - len(raw.lstrip()), raw.strip().lstrip("- ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = re.match(r'Parser key "([^"]+)":', line)
        if key:
            stack.append((indent, key.group(1)))
            continue
        if not line or line.startswith(LINES_OF_THE_REPORT) or "NoneType" in line:
            continue
        keys = [k for _, k in stack]
        if len(keys) > best[0]:
            best = (len(keys), keys, line)
    _, keys, line = best
    if keys[:1] == ["model"]:  # the CLI's `model` is the module: its arguments are under init_args
        keys = ["model.init_args", *keys[1:]]
    key = ".".join(keys)
    unknown = re.match(r"unrecognized arguments: --(\S+?)(=|$)", line)
    if unknown:
        return f"{'.'.join(filter(None, [key, unknown.group(1)]))} is not an option (lit-rlvr fit --help lists them)"
    typed = re.match(r"Expected a <class '(\w+)'>(?:\. Got value: (.*))?", line)
    if typed and key:
        value, expected = typed.group(2), TYPE_NAMES.get(typed.group(1), typed.group(1))
        if value is None:
            return f"{key} is not valid: expected {expected}"
        finite = value.lower().lstrip("+-.") in ("inf", "nan", "infinity")
        return f"{key}={value} is not valid: expected {'a finite number' if finite else expected}"
    return f"{key}: {line}" if key else line


# the lines of jsonargparse's report that say where it looked, not what was wrong
LINES_OF_THE_REPORT = ("Does not validate", "Subtypes:", "Errors:", "Problem with given class_path", "Given value",
                       "Not a valid subclass", "Import path")
TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


class RLVRArgumentParser(LightningArgumentParser):
    """A value the parser refuses is one line naming the key (`parse_error_line`), as a check's is."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # a trial parse inside jsonargparse: it handles the refusal itself
            return super().error(message, ex)
        with config_phase():
            raise ConfigError([parse_error_line(message)]) from None


class RLVRCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("seed_everything", "model.init_args.seed")
        parser.link_arguments("seed_everything", "data.seed")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Checkpoints written as train.py writes them (`AtomicCheckpointIO`: whole or absent; a full disk is one
        line naming the file), unless the config sets its own checkpoint IO."""
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        key = "--trainer.logger.init_args.save_dir" if trainer.loggers else "--trainer.default_root_dir"
        run_dir = Path(trainer.log_dir or trainer.default_root_dir).absolute()
        with config_phase():  # before config.yaml, metrics and checkpoints go there: a read-only dir is one line
            check_writable_dir(run_dir, key)
            hold_run_dir(run_dir, key, None)  # a new directory for every run (lit_rlvr/run/run_lock.py)
        return trainer

    def instantiate_classes(self) -> None:
        """A constructor's check fails as itself (one line from `main`), not inside jsonargparse's wrappers."""
        try:
            with config_phase():
                super().instantiate_classes()
        except Exception as err:
            root = root_cause(err)
            if root is err or debug():
                raise
            with config_phase():
                raise root from None


def main(args=None) -> None:
    """Console script `lit-rlvr`; `args` (a list) instead of sys.argv for programmatic use. An option out of range
    (lit_rlvr.config.options), another config error, or a file that cannot be written exits with one line naming the
    CLI's key, as train.py does with its own (lit_rlvr/run/one_line.py)."""
    with one_line_errors(key_prefixes=CLI_KEYS):
        RLVRCLI(GRPOModule, RLVRDataModule, subclass_mode_model=True, seed_everything_default=0,
                save_config_kwargs={"overwrite": True}, parser_class=RLVRArgumentParser, args=args)


if __name__ == "__main__":
    main()
