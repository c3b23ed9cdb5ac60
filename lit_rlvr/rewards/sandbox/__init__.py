"""The code reward's sandbox: where a completion's program runs. `local` runs it in a fresh isolated process on this
machine (with `launcher.py`, the stdlib-only script that sets up the isolation, and `harness.py`, the call-based
tests' driver, both run by path, never imported); `remote` sends it to a SandboxFusion-compatible server. The
reward that decides what to run and how to compare the output is lit_rlvr/rewards/code.py."""
