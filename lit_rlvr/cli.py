"""`lit-rlvr`: the Lightning CLI over `GRPOModule` (and its subclasses) and `RLVRDataModule`.

    lit-rlvr fit --config conf/cli/tiny_grpo.yaml [--trainer.max_steps 5] [--ckpt_path last.ckpt]
    lit-rlvr validate --config conf/cli/tiny_grpo.yaml --ckpt_path outputs/cli/tiny_grpo/checkpoints/last.ckpt

The model is chosen in subclass mode (`model: {class_path: ..., init_args: ...}`): any GRPOModule subclass,
by import path (`lit_rlvr.algorithms.DAPOModule`, `my_losses.MyModule`) or short name for the shipped ones.
Choose it in the config file: `--model X` given after `--config` keeps the init_args the config resolved,
including the first class's defaults (jsonargparse issue #460). `seed_everything` also
seeds the module's sampling and the data order, as `seed=` does for train.py. Hydra's `train.py` is the
recipe with before/after evaluation and summary.json; this entry is plain Lightning.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lit_rlvr.algorithms  # noqa: F401  (registers DAPOModule, DrGRPOModule, GSPOModule for short names)
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.entry import one_line_errors
from lit_rlvr.module import GRPOModule


class RLVRCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("seed_everything", "model.init_args.seed")
        parser.link_arguments("seed_everything", "data.seed")


def main(args=None) -> None:
    """Console script `lit-rlvr`; `args` (a list) instead of sys.argv for programmatic use. An option out of range
    (lit_rlvr.options) exits with one line naming the CLI's key, as train.py does with its own."""
    with one_line_errors(key_prefixes={"algorithm.": "model.init_args."}):
        RLVRCLI(GRPOModule, RLVRDataModule, subclass_mode_model=True, seed_everything_default=0,
                save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
