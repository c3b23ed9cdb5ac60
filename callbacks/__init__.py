"""Lightning callbacks that implement the papers; installed as `lit_rlvr.callbacks` (DESIGN §1)."""

from .completions_log import CompletionsLog
from .param_noise import ParamNoise
from .value_prior import ValuePrior
from lit_rlvr.run_checkpoint import RunCheckpoint  # run infrastructure (lit_rlvr/), importable here too

__all__ = ["CompletionsLog", "ParamNoise", "RunCheckpoint", "ValuePrior"]
