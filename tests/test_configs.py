"""Every shipped config composes; every algorithm builds its module, callbacks and trainer; bad values name the key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lit_rlvr.callbacks.param_noise import ParamNoise
from lit_rlvr.app.recipe import build_module, build_trainer, check_run_dir, train

CONF = Path(__file__).resolve().parents[1] / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(*overrides: str):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):  # what a real run sets: loggers write into the run directory
        cfg.hydra.runtime.output_dir = cfg.hydra.run.dir
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.mark.parametrize("group", ["model", "engine", "trainer", "logger", "reward"])
def test_every_option_composes(group):
    for option in _options(group):
        cfg = _compose(f"{group}={option}")
        assert cfg[group] is not None


@pytest.mark.parametrize("algorithm", _options("algorithm"))
def test_every_algorithm_builds_module_and_trainer(algorithm, tiny_path, tmp_path):
    cfg = _compose(f"algorithm={algorithm}", f"hydra.run.dir={tmp_path}", f"model.name_or_path={tiny_path}")
    module = build_module(cfg)
    trainer = build_trainer(cfg, tmp_path)
    assert module.algorithm.group_size >= 1
    wanted = set((cfg.algorithm.get("callbacks") or {}).keys())
    names = {type(cb).__name__ for cb in trainer.callbacks}
    assert len(wanted) <= len(names)
    assert any(type(lg).__name__ == "CSVLogger" for lg in trainer.loggers)


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.loss_aggregation=bogus", "algorithm.loss_aggregation"),
        ("algorithm.kl_estimator=k9", "algorithm.kl_estimator"),
        ("algorithm.dual_clip=1.0", "algorithm.dual_clip=1.0"),
        ("algorithm.kl_k3_cap=10 algorithm.kl_estimator=k2", "algorithm.kl_k3_cap=10"),
        ("algorithm.group_size=0", "algorithm.group_size"),
        ("algorithm.top_p=0", "top_p"),
        ("engine.options.mode=bogus", "engine.options.mode"),
        ("engine.name=bogus", "engine.name='bogus' is not valid"),
        ("reward.name=bogus", "reward="),
        ("model.dtype=float8", "model.dtype"),
    ],
)
def test_invalid_values_name_the_key(override, message, tiny_path, tmp_path):
    cfg = _compose(*override.split(), f"hydra.run.dir={tmp_path}", f"model.name_or_path={tiny_path}")
    with pytest.raises(ValueError, match=message):
        module = build_module(cfg)
        module.setup("fit")


def test_missing_model_path_fails_before_work(tmp_path):
    cfg = _compose(f"model.name_or_path={tmp_path / 'nope'}", f"hydra.run.dir={tmp_path}")
    with pytest.raises(FileNotFoundError, match="model.name_or_path"):
        build_module(cfg)


def test_multi_process_run_needs_a_fixed_run_dir(tmp_path, monkeypatch):
    """Each torchrun rank resolves the default `${now:…}` run dir on its own clock: refused, naming the key."""
    default, fixed = _compose(), _compose(f"hydra.run.dir={tmp_path}")
    check_run_dir(default.hydra)  # one process: the default is fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="hydra.run.dir"):
        check_run_dir(default.hydra)
    check_run_dir(fixed.hydra)


def test_missing_resume_checkpoint_fails_first_and_points_to_an_interrupted_save(tmp_path):
    missing = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(FileNotFoundError, match="resume=.*no such checkpoint"):
        train(_compose(f"resume={missing}", f"hydra.run.dir={tmp_path}"), tmp_path)
    (tmp_path / "checkpoints" / "last.ckpt.old").mkdir(parents=True)  # a sharded save stopped between renames
    with pytest.raises(FileNotFoundError, match="last.ckpt.old holds the checkpoint"):
        train(_compose(f"resume={missing}", f"hydra.run.dir={tmp_path}"), tmp_path)


def test_m3po_with_one_completion_per_weight_sample_fails_before_any_work(tmp_path):
    """`algorithm=m3po algorithm.group_size=4` (N = 4): every within-chunk advantage is 0. The run stops before the
    model loads, naming both keys and why."""
    cfg = _compose("algorithm=m3po", "algorithm.group_size=4", "trainer.max_steps=1", "eval_before=false",
                   "data.num_test=16", f"hydra.run.dir={tmp_path}")
    with pytest.raises(ValueError, match=r"algorithm\.group_size=4.*algorithm\.callbacks\.param_noise\.num_samples=4"
                                         r".*advantage"):
        train(cfg, tmp_path)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()


def test_c3po_paper_matches_the_released_run():
    """The settings of the released C3PO run that the library can express (conf/algorithm/c3po_paper.yaml lists
    what differs on purpose)."""
    algorithm = _compose("algorithm=c3po_paper").algorithm
    assert algorithm.loss_aggregation == "token-mean"
    assert (algorithm.warmup_steps, algorithm.warmup_from_zero) == (34, True)
    assert algorithm.dual_clip == 3.0 and algorithm.kl_coef == 0.0 and algorithm.temperature == 1.0
    noise = algorithm.callbacks.param_noise
    assert (algorithm.group_size, ParamNoise(noise.variant, noise.num_samples).num_samples) == (16, 4)
    assert (algorithm.ppo_epochs, algorithm.mini_batches) == (1, 1)
    assert (algorithm.lr, algorithm.optimizer_options.ess, algorithm.optimizer_options.clip_radius) == (1.0, 1e9, 1e-3)
