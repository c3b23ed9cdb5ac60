"""The Lightning CLI example (conf/cli/tiny_grpo.yaml) trains with the Hydra default's settings: every module
setting and data argument it ends up with (its own values, else the classes' defaults) equals what `python train.py`
passes, but for the few that make it a short example (`SHORTER`). Its lr was once 2e-3, which collapses the
tiny policy (see docs/results/tiny_presets.md)."""

import inspect
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.config.arguments import GROUPS, ModuleSettings, module_settings
from lit_rlvr.app.recipe import module_arguments

REPO = Path(__file__).resolve().parents[1]
SHORTER = {"batch_size", "num_test"}  # data: a 5-step example on fewer prompts
SET_BY_THE_CLI = {"seed"}  # linked to seed_everything, as seed= does for train.py


def _defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}


def _cli() -> tuple[ModuleSettings, dict]:
    config = yaml.safe_load((REPO / "conf" / "cli" / "tiny_grpo.yaml").read_text())
    args = config["model"]["init_args"]
    groups = {name: args.get(name) for name in GROUPS}
    return module_settings(**groups, seed=config["seed_everything"], shortcuts={}), {
        **_defaults(RLVRDataModule), **config["data"]}


def _hydra() -> tuple[ModuleSettings, dict]:
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config")
    args = module_arguments(cfg)
    args.pop("_target_")
    settings = module_settings(**{name: args[name] for name in GROUPS}, seed=args["seed"], shortcuts={})
    data = OmegaConf.to_container(cfg.data, resolve=False)
    data.pop("_target_")
    return settings, {**_defaults(RLVRDataModule), **data}


def _without_cache_dirs(settings: ModuleSettings) -> dict:
    """The settings as plain values but the cache paths: the CLI's module reads $LIT_RLVR_CACHE itself."""
    values = settings.as_dict()
    values["model"]["options"].pop("cache_dir", None)
    values["perf"].pop("cache_dir", None)
    return values


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def test_cli_example_agrees_with_hydra_defaults():
    """Every setting the CLI example's module gets (its own values, else the settings classes' defaults) equals what
    `python train.py` gives it; the data module's arguments too, but for the few that make the example short."""
    (cli, cli_data), (hydra, hydra_data) = _cli(), _hydra()
    cli_values, hydra_values = _without_cache_dirs(cli), _without_cache_dirs(hydra)
    differ = {f"{group}.{k}": (v, hydra_values[group].get(k)) for group, values in cli_values.items()
              if isinstance(values, dict) for k, v in values.items() if not _same(v, hydra_values[group].get(k))}
    assert not differ, f"conf/cli/tiny_grpo.yaml (CLI, Hydra): {differ}"
    differ = {k: (cli_data.get(k), hydra_data.get(k)) for k in sorted(set(cli_data) | set(hydra_data))
              if k not in SHORTER | SET_BY_THE_CLI and not _same(cli_data.get(k), hydra_data.get(k))}
    assert not differ, f"conf/cli/tiny_grpo.yaml data (CLI, Hydra): {differ}"


def test_cli_trainer_matches_hydra_trainer():
    config = yaml.safe_load((REPO / "conf" / "cli" / "tiny_grpo.yaml").read_text())["trainer"]
    hydra = yaml.safe_load((REPO / "conf" / "trainer" / "cpu.yaml").read_text())
    for key in ("accelerator", "precision", "max_epochs", "num_sanity_val_steps", "check_val_every_n_epoch"):
        assert config[key] == hydra[key], key
