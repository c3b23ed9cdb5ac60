"""Configuration: the typed settings (`settings`) and their Hydra schemas (`schemas`), every error class (`errors`),
the table of option ranges and its rules (`options`, `problems`), the bounds of a rollout against the model's
context (`bounds`) and optional dependencies (`extras`). The checks of a composed `train.py` config are the entry
points' (`lit_rlvr.app.config_check`, `lit_rlvr.app.hydra_checks`). docs/architecture.md §1 says which may import
what."""
