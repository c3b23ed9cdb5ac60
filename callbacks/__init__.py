"""Lightning callbacks that implement the papers' methods (and measure them); installed as `lit_rlvr.callbacks`
(docs/architecture.md §1). Run infrastructure (checkpoints, metrics) lives in `lit_rlvr` itself."""

from .completions_log import CompletionsLog
from .param_noise import ParamNoise
from .value_prior import ValuePrior

__all__ = ["CompletionsLog", "ParamNoise", "ValuePrior"]
