"""The entry points and what only they use: the Hydra recipe (`recipe`, run by `train.py` and `lit-rlvr-train`:
`entry`), the Lightning CLI (`lit-rlvr`: `cli`), and the checks of a composed `train.py` config before any work
(`config_check`, `hydra_checks`). The top layer: nothing in the library imports it (docs/architecture.md §1)."""
