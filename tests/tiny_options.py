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
# RL's held-out mean@4 where the warm-up leaves the model: it stops at the first check at or above the target on
# its own dev problems (checks every `eval_every` steps, so it may overshoot by a few points), and RL's held-out
# problems are others of the same kind
BAND = (TINY["target"] - 0.06, TINY["target"] + 0.12)
# the environment of `train.py` subprocesses of the tiny model: 1 thread, as its ops are too small for more (with 2,
# a default step's update took ~3x as long on a 2-core AMD EPYC), and tests run several such processes side by side
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
