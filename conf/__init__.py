"""The recipe's Hydra configs, installed as `lit_rlvr.conf` (see setup.cfg); `lit-rlvr-train` reads them."""
