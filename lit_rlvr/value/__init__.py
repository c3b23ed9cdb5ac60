"""V0, the generalist value model of V0.5 (docs/architecture.md §6): backbone → adapter → head, fit in context.

    model = ValueModel.create(backbone="minilm", head="kernel")
    p_hat, metrics = model.predict(prompts, context)       # p_hat [B] in [0, 1], or None until context is ready
    prior = 2 * p_hat - 1                                   # on the ±1 reward scale, for shrinkage_fusion

Nothing here trains: the backbone is frozen, the adapter fixed (seeded or loaded), the head fit in closed
form (kernel) or in context (TabPFN) on the context buffer at every call. A prompt's features are a pure
function of its text, so they can be computed ahead in large batches (`precompute`); the kernel head's
bandwidth search (and standardization) reruns once `bandwidth_refit` of the context is new since the last.
"""

from lit_rlvr.value.adapter import ResidualQueryAdapter, load_adapter, save_adapter
from lit_rlvr.value.backbone import CachedBackbone, EmbeddingBackbone, PolicyHiddenStates
from lit_rlvr.value.buffer import ContextBuffer
from lit_rlvr.value.heads import KernelHead, TabPFNHead
from lit_rlvr.value.model import FEATURE_MODES, HEADS, ValueModel

__all__ = [
    "FEATURE_MODES",
    "HEADS",
    "CachedBackbone",
    "ContextBuffer",
    "EmbeddingBackbone",
    "KernelHead",
    "PolicyHiddenStates",
    "ResidualQueryAdapter",
    "TabPFNHead",
    "ValueModel",
    "load_adapter",
    "save_adapter",
]
