"""The update: a batch with advantages → optimizer steps, built from explicit parts (`Update`, the driver's twin),
with its parts: the micro-batch planner, the forward, the rollout correction's runtime half."""

from lit_rlvr.update.correction import RolloutCorrector
from lit_rlvr.update.forward import forward_logprobs
from lit_rlvr.update.micro_batches import MicroBatchPlan, plan_micro_batches
from lit_rlvr.update.update import SEQUENCE_METRICS, TOKEN_METRICS, Update, loss_passes

__all__ = ["MicroBatchPlan", "RolloutCorrector", "SEQUENCE_METRICS", "TOKEN_METRICS", "Update", "forward_logprobs",
           "loss_passes", "plan_micro_batches"]
