"""One default per setting, whatever the entry point: `python train.py`'s composed config, the Lightning CLI's
parser, `GRPOModule`'s and `RLVRDataModule`'s signatures, `SamplingConfig`/`SamplingParams`, the callbacks' and the
engines' constructors against their conf entries. The Lightning CLI example (conf/cli/tiny_grpo.yaml) trains with the
Hydra default's settings but for the few that make it a short example (`SHORTER`); its lr was once 2e-3, which
collapses the tiny policy (see docs/results/tiny_presets.md)."""

import inspect
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from lightning.pytorch.cli import LightningArgumentParser
from omegaconf import OmegaConf

from lit_rlvr.config.arguments import GROUPS, ModuleSettings, module_settings
from lit_rlvr.config.settings import DataConfig, SamplingOptions
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.module import GRPOModule
from lit_rlvr.app.recipe import module_arguments
from lit_rlvr.rollout.engine import SamplingConfig, SamplingParams
from lit_rlvr.rollout.lora import SyncCheck

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


# -- one default per setting: every entry point's default is the settings class's (issue 59) ----------------------
def _compose_default():
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("config")


def _flat(value, prefix=""):
    if isinstance(value, Mapping) and value:
        return {k: v for key, item in value.items()
                for k, v in _flat(item, f"{prefix}.{key}" if prefix else key).items()}
    return {prefix: list(value) if isinstance(value, tuple) else value}


def test_module_signature_defaults_are_the_settings_classes():
    """`GRPOModule()` in Python takes each group's class defaults (one object per group, nothing else)."""
    parameters = inspect.signature(GRPOModule.__init__).parameters
    for group, cls in GROUPS.items():
        assert parameters[group].default == cls(), group


def test_data_defaults_are_the_settings():
    """`RLVRDataModule`'s constructor defaults (Python's and the Lightning CLI's) are `DataConfig`'s, and the
    embedded default's data config (`python train.py`) composes exactly those values."""
    settings = {f.name: f.default for f in fields(DataConfig)}
    assert _defaults(RLVRDataModule) == settings
    composed = OmegaConf.to_container(_compose_default().data, resolve=True)
    composed.pop("_target_")
    differ = {k: (v, settings[k]) for k, v in composed.items() if not _same(v, settings[k])}
    assert not differ, f"conf/data/arithmetic.yaml (YAML, DataConfig): {differ}"
    assert (settings["batch_size"], settings["eval_batch_size"]) == (64, 128)


def test_sampling_defaults_are_the_algorithm_settings():
    """`SamplingConfig` and `SamplingParams` (an engine call's options) default to `SamplingOptions`' values, which
    the embedded default composes too: max_new_tokens 8, eval_temperature 1 (held-out mean@k is sampled)."""
    options = {f.name: f.default for f in fields(SamplingOptions)}
    for cls in (SamplingConfig, SamplingParams):
        shared = {f.name: f.default for f in fields(cls) if f.name in options}
        assert len(shared) >= 5, cls
        assert shared == {k: options[k] for k in shared}, cls.__name__
    algorithm = _compose_default().algorithm
    assert {k: algorithm[k] for k in options} == options
    assert (options["max_new_tokens"], options["eval_temperature"]) == (8, 1.0)


def _cli_defaults() -> dict:
    """The Lightning CLI's defaults of the module's groups and the data module's arguments, as its parser sets them
    (each group's `init_args` where it is a class), flat: `algorithm.lr`, `data.batch_size`."""
    parser = LightningArgumentParser()
    parser.add_lightning_class_args(GRPOModule, "model", subclass_mode=False)
    parser.add_lightning_class_args(RLVRDataModule, "data", subclass_mode=False)
    defaults = parser.get_defaults().as_dict()
    groups = {g: v.get("init_args", v) if isinstance(v, dict) else v for g, v in defaults["model"].items()}
    return {**_flat({g: groups[g] for g in GROUPS}), **_flat({"data": defaults["data"]})}


def test_lightning_cli_defaults_are_train_pys():
    """Every default the Lightning CLI's parser gives a module or data setting equals `python train.py`'s composed
    value, but where the embedded default must differ (the tiny model's warm-up settings, paths, the run's name)."""
    cli = _cli_defaults()
    cfg = _compose_default()
    hydra = _flat({g: OmegaConf.to_container(cfg[g], resolve=True) for g in [*GROUPS, "data"]})
    differs = ("model.options", "perf.cache_dir", "algorithm.rollout_correction", "data.seed")  # seed: linked
    compared = {k: v for k, v in cli.items() if k in hydra and not k.startswith(differs)}
    assert len(compared) > 60
    differ = {k: (v, hydra[k]) for k, v in compared.items() if not _same(v, hydra[k])}
    assert not differ, f"(Lightning CLI, train.py): {differ}"
    assert cli["algorithm.max_new_tokens"] == 8 and cli["data.batch_size"] == 64


def _conf_options(path: str, key: str = None) -> dict:
    node = yaml.safe_load((REPO / "conf" / path).read_text())
    return dict(node[key] if key else node)


# conf values that are the run's seed (linked, as seed= is for train.py), not a default of their own
LINKED = {"seed": "${seed}"}
# mappings passed through to another library: null and {} both mean "none given"
PASSED_THROUGH = {"server_args", "llm_args"}


def _constructor_differences(cls, conf: dict, also: dict = ()) -> dict:
    defaults = {**_defaults(cls), **dict(also)}
    out = {}
    for key, value in conf.items():
        if key == "_target_" or LINKED.get(key) == value:
            continue
        default = defaults.get(key, "<no such argument>")
        if key in PASSED_THROUGH and value in ({}, None) and default in ({}, None):
            continue
        if not _same(default, value):
            out[key] = (value, default)
    return out


def test_callbacks_constructor_defaults_are_their_conf_entries():
    """ParamNoise, ValuePrior and CompletionsLog take the values their conf entries give (a Python user's callback
    is train.py's)."""
    for path, key in (("algorithm/callbacks/param_noise.yaml", None), ("algorithm/callbacks/value_prior.yaml", None),
                      ("config.yaml", "callbacks")):
        conf = _conf_options(path, key)
        if key == "callbacks":
            conf = conf["completions"]
        cls = get_class(conf["_target_"])
        assert not _constructor_differences(cls, conf), f"conf/{path} ({cls.__name__}: conf, class)"


def test_engines_constructor_defaults_are_their_conf_entries():
    """Each engine's conf entry (hf, sglang, vllm) holds the engine class's defaults, the post-push check's
    (`SyncCheck`) and the engine builder's (`process`)."""
    check = {f.name: f.default for f in fields(SyncCheck)}
    also = {"sync_check_tol": check["tol"], "sync_check_every": check["every"], "process": False}
    for name, target in (("hf", "lit_rlvr.rollout.hf.HFEngine"), ("sglang", "lit_rlvr.rollout.sglang.SGLangEngine"),
                         ("vllm", "lit_rlvr.rollout.vllm.VLLMEngine")):
        conf = _conf_options(f"engine/{name}.yaml", "options")
        assert not _constructor_differences(get_class(target), conf, also), f"conf/engine/{name}.yaml"
