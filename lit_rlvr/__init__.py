"""lit-rlvr: reinforcement learning with verifiable rewards on PyTorch Lightning."""

import os as _os

# Set before torch loads when lit_rlvr is imported first: spinning OpenMP workers starve each other on a shared
# CPU (steps measured 10-100x slower on a loaded 2-core machine). An explicit value in the environment wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
