"""The README's plain-Python example ("From Python"), executed as written: it builds the module, the data module and
a `lightning.Trainer`, fits and evaluates."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    section = (ROOT / "README.md").read_text().split("## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the section holds one python block"
    return blocks[0]


def test_the_readme_python_example_trains(capsys):
    code = readme_example()
    assert "L.Trainer(" in code and "trainer.fit(module, datamodule=data)" in code
    assert len(code.strip().splitlines()) <= 20  # the example stays about as short as TRL's
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    module, trainer = namespace["module"], namespace["trainer"]
    assert trainer.global_step == 10
    from lit_rlvr.models import load_policy

    start, _ = load_policy(module.model_path)
    moved = [n for (n, p), q in zip(module.policy.named_parameters(), start.parameters()) if not torch.equal(p, q)]
    assert moved, "fit changed no weight"
    assert module.reward_runner.fn is namespace["reward"]  # the user's own function scored the rollouts
    assert re.search(r"held-out accuracy \d\.\d{3} -> \d\.\d{3}", capsys.readouterr().out)


def test_python_defaults_are_the_default_runs_task_and_model():
    """`GRPOModule(model="tiny")` and `RLVRDataModule()` get train.py's default levels, so the README example reuses
    the warm-up `python train.py` cached (and trains on the same task)."""
    import inspect

    from omegaconf import OmegaConf

    from lit_rlvr.data.datamodule import RLVRDataModule
    from lit_rlvr.rollout.warmup import warm_start_tiny

    data_cfg = OmegaConf.load(ROOT / "conf/data/arithmetic.yaml")
    model_cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/tiny.yaml").options, resolve=False)
    assert tuple(RLVRDataModule().hparams.levels) == tuple(data_cfg.levels)
    defaults = {k: p.default for k, p in inspect.signature(warm_start_tiny).parameters.items() if k != "cache_dir"}
    for key, value in model_cfg.items():
        if key != "cache_dir":
            assert list(defaults[key]) == list(value) if key == "levels" else defaults[key] == value, key
