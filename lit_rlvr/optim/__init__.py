"""Optimizers: IVON (ivon-opt, GPL-3.0-or-later) made seedable, shard-aware and Lightning-friendly."""

from lit_rlvr.optim.ivon import IVON, PosteriorSnapshot, bf16_spacing_warning, sample_seed

__all__ = ["IVON", "PosteriorSnapshot", "bf16_spacing_warning", "sample_seed"]
