"""Lightning callbacks that implement the papers; installed as `lit_rlvr.callbacks` (DESIGN §1)."""

from .completions_log import CompletionsLog
from .param_noise import ParamNoise
from .run_checkpoint import RunCheckpoint
from .value_prior import ValuePrior

__all__ = ["CompletionsLog", "ParamNoise", "RunCheckpoint", "ValuePrior"]
