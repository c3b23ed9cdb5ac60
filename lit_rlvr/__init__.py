"""lit-rlvr: reinforcement learning with verifiable rewards on PyTorch Lightning."""

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
