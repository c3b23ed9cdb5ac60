"""lit-rlvr: reinforcement learning with verifiable rewards on PyTorch Lightning."""

import importlib as _importlib
import os as _os

# Set before torch loads when lit_rlvr is imported first; explicit values in the environment win.
# libgomp's default (spin ~3 ms after each parallel region) starved other thread teams on a shared CPU (steps
# 10-100x slower on a loaded 2-core machine); fully passive waiting costs ~15 us of thread wake-up per op
# (a 64x12x64 multiply: 25 us passive vs 10 us), which is most of a small model's time. A short spin (~0.1 ms:
# GOMP_SPINCOUNT overrides the passive policy) keeps the workers awake between back-to-back ops and bounds
# what they burn when idle; measured faster than passive both idle and with 4 busy processes on 2 cores.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"

# The public classes, imported on first use: `import lit_rlvr` stays free of torch (reward worker processes import
# `lit_rlvr.config`), and the library itself never imports `lit_rlvr.callbacks` (docs/architecture.md §1): only a
# user's `from lit_rlvr import ParamNoise` does.
_EXPORTS = {
    "GRPOModule": "lit_rlvr.module",
    "RLVRDataModule": "lit_rlvr.data.datamodule",
    "ParamNoise": "lit_rlvr.callbacks",
    "ValuePrior": "lit_rlvr.callbacks",
    "SamplingConfig": "lit_rlvr.rollout.engine",
    "LoraOptions": "lit_rlvr.config.settings",
    # the typed settings, one per config group (lit_rlvr/config/settings.py)
    **dict.fromkeys(("AlgorithmConfig", "ModelConfig", "RewardConfig", "EngineConfig", "EnvConfig", "PerfConfig",
                     "RolloutConfig",
                     "LossConfig", "UpdateConfig", "OptimConfig", "SamplingOptions"), "lit_rlvr.config.settings"),
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_rlvr' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
