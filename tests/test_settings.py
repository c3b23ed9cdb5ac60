"""The typed settings (lit_rlvr/config/settings.py) are the schemas of train.py's groups: the Python defaults are
train.py's, the YAMLs hold only what differs, and the composed groups convert back to the classes."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lit_rlvr.config.schemas import RECIPE_KEYS, SCHEMAS, AlgorithmGroup
from lit_rlvr.config.settings import AlgorithmConfig, EnvConfig, FilterGroups, LoraOptions, ModelConfig, part

REPO = Path(__file__).resolve().parents[1]
# where the embedded default must differ from a class default: the tiny model's warm-up settings (model=tiny)
DIFFERS = {"model.options", "perf.cache_dir", "algorithm.name", "algorithm.rollout_correction"}


def _compose(*overrides: str):
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _flat(value, prefix):
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}.{key}").items()}
    return {prefix: list(value) if isinstance(value, tuple) else value}


def test_python_defaults_are_train_pys():
    """Every field of `AlgorithmConfig()`, `ModelConfig()`, ... equals the embedded default's composed value
    (lr 3e-4, max_new_tokens 8, eval_temperature 1, eval_samples 4), but the keys that say why they differ."""
    cfg = _compose()
    compared = 0
    for section, cls in SCHEMAS.items():
        composed = _flat(OmegaConf.to_container(cfg[section], resolve=True), section)
        defaults = _flat(OmegaConf.to_container(OmegaConf.structured(cls)), section)
        for key, default in defaults.items():
            if any(key == d or key.startswith(d + ".") for d in DIFFERS):
                continue
            assert composed[key] == default, key
            compared += 1
    assert compared > 50
    algorithm = AlgorithmConfig()
    assert (algorithm.lr, algorithm.max_new_tokens, algorithm.eval_temperature, algorithm.eval_samples) == (
        3e-4, 8, 1.0, 4)


@pytest.mark.parametrize("overrides", [[], ["algorithm=dapo", "model.lora.rank=8"], ["algorithm=c3po_v05"],
                                       ["env=retry"], ["data=arithmetic_cot"]])
def test_composed_groups_convert_to_the_classes(overrides):
    """The recipe builds the classes from the composed groups (typed nested settings included)."""
    cfg = _compose(*overrides)
    algorithm = OmegaConf.to_object(cfg.algorithm)
    assert isinstance(algorithm, AlgorithmGroup) and isinstance(algorithm.filter_groups, FilterGroups)
    container = OmegaConf.to_container(cfg.algorithm, resolve=True)  # recipe.build_module's way
    plain = AlgorithmConfig(**{k: v for k, v in container.items() if k not in RECIPE_KEYS})
    assert plain == part(AlgorithmConfig, algorithm)
    model = OmegaConf.to_object(cfg.model)
    assert isinstance(model, ModelConfig) and isinstance(model.lora, LoraOptions)
    assert isinstance(OmegaConf.to_object(cfg.env), EnvConfig)


def test_yamls_hold_only_differences():
    """No shipped group YAML repeats a class default (the LoRA block lives once, in `LoraOptions`)."""
    for group in ("model", "engine", "reward", "env"):
        for path in (REPO / "conf" / group).glob("*.yaml"):
            assert "lora:" not in path.read_text(), path
    cfg = _compose("algorithm=dapo")
    assert cfg.algorithm.filter_groups.metric == "acc" and cfg.model.lora.alpha == 32.0  # from the classes
