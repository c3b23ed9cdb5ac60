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

from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI

from lit_rlvr.config.arguments import GROUPS
from lit_rlvr.config.errors import debug
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.module import GRPOModule
from lit_rlvr.run.checkpoint_io import AtomicCheckpointIO
from lit_rlvr.run.one_line import config_phase, one_line_errors, rename_keys, root_cause
from lit_rlvr.run.storage import check_writable_dir


# the module's arguments are train.py's config groups: a key is the same under one prefix (`algorithm.lr` is
# `model.init_args.algorithm.lr`)
CLI_KEYS = {f"{group}.": f"model.init_args.{group}." for group in GROUPS}


def cli_keys(line: str) -> str:
    """A check's message with train.py's key names (`algorithm.group_size`) as this CLI's
    (`model.init_args.algorithm.group_size`)."""
    return rename_keys(line, CLI_KEYS)


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
        with config_phase():  # before config.yaml, metrics and checkpoints go there: a read-only dir is one line
            check_writable_dir(Path(trainer.log_dir or trainer.default_root_dir).absolute(), key)
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
                save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
