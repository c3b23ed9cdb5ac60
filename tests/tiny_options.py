"""The tiny model's warm-up options as conf/model/tiny.yaml sets them (without cache_dir), so every test that
asks for the tiny model reuses the one cached warm-up, which stops at the config's target accuracy."""

from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]


def tiny_options() -> dict:
    options = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "tiny.yaml").options, resolve=False)
    options.pop("cache_dir", None)  # `${cache_dir}`: the caller's
    return options


TINY = tiny_options()
