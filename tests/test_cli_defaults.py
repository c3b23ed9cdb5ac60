"""The Lightning CLI example (conf/cli/tiny_grpo.yaml) trains with the Hydra default's settings: every module
and data argument it ends up with (its own values, else the classes' defaults) equals what `python train.py`
passes, but for the few that make it a short example (`SHORTER`). Its lr was once 2e-3, which collapses the
tiny policy (see conf/algorithm/grpo.yaml)."""

import inspect
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.module import GRPOModule

REPO = Path(__file__).resolve().parents[1]
SHORTER = {"data.batch_size", "data.num_test"}  # a 5-step example on fewer prompts
SET_BY_THE_CLI = {"model.seed", "data.seed"}  # linked to seed_everything, as seed= does for train.py


def _defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}


def _cli() -> dict:
    config = yaml.safe_load((REPO / "conf" / "cli" / "tiny_grpo.yaml").read_text())
    model = {**_defaults(GRPOModule), **config["model"]["init_args"]}
    data = {**_defaults(RLVRDataModule), **config["data"]}
    return {**{f"model.{k}": v for k, v in model.items()}, **{f"data.{k}": v for k, v in data.items()}}


def _hydra() -> dict:
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config")
    algorithm = OmegaConf.to_container(cfg.algorithm, resolve=True)  # max_new_tokens reads the data config's budget
    for key in ("name", "callbacks", "_target_"):
        algorithm.pop(key)
    options = OmegaConf.to_container(cfg.model.options, resolve=False)
    options.pop("cache_dir")  # the CLI's module reads $LIT_RLVR_CACHE itself
    model = {**_defaults(GRPOModule), **algorithm, "model": cfg.model.name_or_path, "model_options": options,
             "dtype": cfg.model.dtype, "reward": cfg.reward.name, "engine": cfg.engine.name,
             "engine_options": OmegaConf.to_container(cfg.engine.options)}
    data = OmegaConf.to_container(cfg.data, resolve=False)
    data.pop("_target_")
    data = {**_defaults(RLVRDataModule), **data}
    return {**{f"model.{k}": v for k, v in model.items()}, **{f"data.{k}": v for k, v in data.items()}}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b or (a is None and b == {}) or (a == {} and b is None)


def test_cli_example_agrees_with_hydra_defaults():
    cli, hydra = _cli(), _hydra()
    differ = {k: (cli.get(k), hydra.get(k)) for k in sorted(set(cli) | set(hydra))
              if k not in SHORTER | SET_BY_THE_CLI and not _same(cli.get(k), hydra.get(k))}
    assert not differ, f"conf/cli/tiny_grpo.yaml (CLI, Hydra): {differ}"


def test_cli_trainer_matches_hydra_trainer():
    config = yaml.safe_load((REPO / "conf" / "cli" / "tiny_grpo.yaml").read_text())["trainer"]
    hydra = yaml.safe_load((REPO / "conf" / "trainer" / "cpu.yaml").read_text())
    for key in ("accelerator", "precision", "max_epochs", "num_sanity_val_steps", "check_val_every_n_epoch"):
        assert config[key] == hydra[key], key
