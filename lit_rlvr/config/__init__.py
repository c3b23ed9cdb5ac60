"""Configuration: the typed settings (`settings`) and their Hydra schemas (`schemas`), every error class (`errors`),
the table of option ranges and its rules (`options`, `problems`), the bounds of a rollout against the model's
context (`bounds`), optional dependencies (`extras`), and the checks of a composed `train.py` config
(`config_check`, `hydra_checks`). docs/architecture.md §1 says which may import what."""
