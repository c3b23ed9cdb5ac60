"""V0, the generalist value model of V0.5 (DESIGN §6): backbone → adapter → head, fit in context.

    model = ValueModel.create(backbone="minilm", head="kernel")
    p_hat, metrics = model.predict(prompts, context)       # p_hat [B] in [0, 1], or None until context is ready
    prior = 2 * p_hat - 1                                   # on the ±1 reward scale, for shrinkage_fusion

Nothing here trains: the backbone is frozen, the adapter fixed (seeded or loaded), the head fit in closed
form (kernel) or in context (TabPFN) on the context buffer at every call. A prompt's features are a pure
function of its text, so they can be computed ahead in large batches (`precompute`); the kernel head's
bandwidth search (and standardization) reruns once `bandwidth_refit` of the context is new since the last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Union

import contextlib
import time

import torch
from torch import Tensor

from lit_rlvr.value.adapter import ResidualQueryAdapter, load_adapter, save_adapter
from lit_rlvr.value.backbone import CachedBackbone, EmbeddingBackbone, PolicyHiddenStates, mean_pool
from lit_rlvr.value.buffer import ContextBuffer
from lit_rlvr.value.heads import KernelHead, TabPFNHead

Head = Union[KernelHead, TabPFNHead]
FEATURE_MODES = ("auto", "adapter", "pooled")
HEADS = {"kernel": KernelHead, "tabpfn": TabPFNHead}

__all__ = [
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


@contextlib.contextmanager
def _one_thread(enabled: bool = True) -> Iterator[None]:
    """Run the block on one CPU thread. The kernel head's per-step ops are small (a few hundred KB); with
    two threads each op wakes the second one, which on a loaded machine costs milliseconds (measured: the
    head's step 3× faster on one thread at load 8 on 2 cores, and no slower idle). The policy's threads are
    restored after."""
    before = torch.get_num_threads()
    if not enabled or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ValueModel:
    """Ties a backbone, a residual query adapter and a head.

    Args:
        backbone: gives token states of prompts (cached per prompt text).
        head: `KernelHead` or `TabPFNHead`; refit on the context at every `predict`.
        adapter: the residual query adapter; built from `seed` when None and features == "adapter".
        features: "adapter" (adapter(backbone(prompts)), K·width features, the paper's path), "pooled"
            (the backbone's mean-pooled embedding, D features) or "auto" (default): "adapter" when adapter
            weights are given, else "pooled". Why: an untrained adapter is a lossy random projection; on the
            arithmetic task with a level-dependent policy, KernelHead's p̂ correlates 0.78 with the true
            success rate over pooled MiniLM features vs 0.63 over a random adapter's.
        seed: init seed of the adapter built when features == "adapter" and none is given.
        bandwidth_refit: the kernel head searches its geometry again (feature standardization and the
            bandwidth by leave-one-out over the scale grid: the costly part of a fit, S exps over the M×M
            context distances) once this fraction of the context's records is new since the last search; in
            between it fits the current context's records with that geometry. 0 = search at every predict.
            With the same context both give the same p̂.
    """

    def __init__(
        self,
        backbone: CachedBackbone,
        head: Head,
        adapter: Optional[ResidualQueryAdapter] = None,
        features: str = "auto",
        seed: int = 0,
        bandwidth_refit: float = 0.0,
    ) -> None:
        if features not in FEATURE_MODES:
            raise ValueError(f"ValueModel: features={features!r} is not one of {FEATURE_MODES}")
        if features == "auto":
            features = "adapter" if adapter is not None else "pooled"
        if features == "adapter" and adapter is None:
            adapter = ResidualQueryAdapter(backbone.dim, seed=seed)
        self.backbone, self.head, self.adapter, self.features_mode = backbone, head, adapter, features
        if not 0.0 <= bandwidth_refit <= 1.0:
            raise ValueError(f"ValueModel: bandwidth_refit must be in [0, 1], got {bandwidth_refit}")
        self.bandwidth_refit = bandwidth_refit
        self._feature_cache: dict[str, Tensor] = {}  # prompt → [F]: the context's and this step's prompts
        self._precomputed: dict[str, Tensor] = {}  # prompt → [F]: computed ahead (`precompute`), bounded by the caller
        self._searched_at: Optional[int] = None  # context.total_added at the kernel head's last bandwidth search
        self._context_rows: Optional[tuple[int, int, list[str], Tensor]] = None  # see _context_features
        if adapter is not None:
            adapter.eval().requires_grad_(False)

    @classmethod
    def create(
        cls,
        backbone: str = "minilm",
        head: str = "kernel",
        features: str = "auto",
        adapter_path: Optional[str | Path] = None,
        seed: int = 0,
        max_length: int = 128,
        device: str = "cpu",
        head_kwargs: Optional[dict[str, Any]] = None,
        bandwidth_refit: float = 0.0,
    ) -> "ValueModel":
        """Build from names (what a config holds). `backbone`: "minilm" or an HF embedding model id/path;
        `head`: "kernel" | "tabpfn"; `adapter_path`: saved adapter weights (see `load_adapter`)."""
        if head not in HEADS:
            raise ValueError(f"ValueModel: head={head!r} is not one of {sorted(HEADS)}")
        bb = EmbeddingBackbone(backbone, max_length=max_length, device=device)
        adapter = load_adapter(adapter_path, map_location=device) if adapter_path is not None else None
        if adapter is not None and adapter.config["d_in"] != bb.dim:
            raise ValueError(f"adapter {adapter_path} expects d_in={adapter.config['d_in']}, backbone gives {bb.dim}")
        return cls(bb, HEADS[head](**(head_kwargs or {})), adapter=adapter, features=features, seed=seed,
                   bandwidth_refit=bandwidth_refit)

    @torch.no_grad()
    def features(self, prompts: list[str], *, cache_states: bool = True) -> Tensor:
        """[B, F] float32 features of the prompts. `cache_states=False` keeps the token states out of the
        backbone's cache (bulk precompute: the features are kept, the [L, D] states need not be)."""
        if cache_states or not hasattr(self.backbone, "embed_uncached"):
            states, mask = self.backbone(prompts)  # [B, L, D], [B, L]
        else:
            states, mask = self.backbone.embed_uncached(prompts)  # [B, L, D], [B, L]
        if self.features_mode == "pooled":
            return mean_pool(states, mask).float()  # [B, D]
        adapter = self.adapter.to(states.device)
        return adapter(states, mask).float()  # [B, K·W]

    def prompt_features(self, prompts: list[str]) -> Tensor:
        """[B, F] features, each prompt's computed once, when first seen, and then reused. A checkpoint keeps
        the context's (`feature_state`), so a resumed run fits the head on the very same numbers."""
        self._fill(prompts)
        return torch.stack([self._feature_cache[p] for p in prompts])

    def _fill(self, prompts: list[str]) -> None:
        """Put the features of `prompts` in the cache: computed ahead, or by the backbone now."""
        cache, ahead = self._feature_cache, self._precomputed
        missing = [p for p in dict.fromkeys(prompts) if p not in cache and p not in ahead]
        if missing:
            cache.update(zip(missing, self.features(missing)))
        cache.update((p, ahead[p]) for p in prompts if p not in cache)  # kept with the context from here on

    def precompute(self, prompts: list[str], batch_size: int = 256) -> float:
        """Compute the features of `prompts` ahead, in batches of `batch_size`, and hold them (replacing what
        was held) until `prompt_features` asks. Canonical: a list always gives the same batches, so a resumed
        run gets the same numbers as the uninterrupted one. Returns the seconds it took."""
        t0 = time.perf_counter()
        prompts = list(dict.fromkeys(prompts))
        held: dict[str, Tensor] = {}
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            held.update(zip(chunk, self.features(chunk, cache_states=False)))
        self._precomputed = held
        return time.perf_counter() - t0

    @property
    def num_precomputed(self) -> int:
        return len(self._precomputed)

    def feature_state(self, prompts: list[str]) -> dict[str, Tensor]:
        return {p: self._feature_cache[p] for p in prompts if p in self._feature_cache}

    def load_feature_state(self, state: dict[str, Tensor]) -> None:
        self._feature_cache.update(state)

    def head_state(self) -> dict[str, Any]:
        """What the next fit depends on beyond the context: the kernel head's last search (when, and the
        geometry it found), checkpointed so a resumed run searches or reuses exactly as the uninterrupted
        run would."""
        if self._searched_at is None or not hasattr(self.head, "geometry"):
            return {}
        return {"searched_at": self._searched_at, "geometry": self.head.geometry()}

    def load_head_state(self, state: dict[str, Any]) -> None:
        if state.get("searched_at") is not None and hasattr(self.head, "load_geometry"):
            self.head.load_geometry(state["geometry"])
            self._searched_at = int(state["searched_at"])

    def _context_features(self, context: ContextBuffer, prompts: list[str]) -> Tensor:
        """[M, F] float64 features of the context's records. The context is a ring buffer that gains a few
        records per step, so last step's matrix is reused: drop the rows that fell out, append the new ones
        (instead of stacking and converting M rows every step). The prompts of the kept rows are checked."""
        end = context.total_added  # records [end − M, end) are in the context
        start = end - len(prompts)
        held = self._context_rows  # (start, end, prompts, [end − start, F]) of the last call, or None
        if held is not None and held[0] <= start <= held[1] <= end and held[2][start - held[0]:] == prompts[: held[1] - start]:
            kept, fresh = held[3][start - held[0]:], prompts[held[1] - start:]  # [K, F], M − K prompts
            x = torch.cat([kept, self.prompt_features(fresh).double()]) if fresh else kept  # [M, F]
        else:
            x = self.prompt_features(prompts).double()  # [M, F]
        self._context_rows = (start, end, prompts, x)
        return x

    def _search_now(self, context: ContextBuffer) -> bool:
        """Search the kernel bandwidth at this fit? Yes the first time and once `bandwidth_refit` of the
        context is new since the last search (always, with bandwidth_refit = 0)."""
        if self._searched_at is None or getattr(self.head, "bandwidth_", None) is None:
            return True
        return context.total_added - self._searched_at >= self.bandwidth_refit * len(context)

    @torch.no_grad()
    def predict(self, prompts: list[str], context: ContextBuffer, *,
                with_metrics: bool = True) -> tuple[Optional[Tensor], dict[str, Tensor]]:
        """p̂ [B] in [0, 1] for the prompts, fit on `context`; None while the context is not ready (then V0.5
        falls back to the plain sample mean). Metrics: `context_size`, and when predicted `p_hat_mean`
        (+ `bandwidth` for the kernel head); `with_metrics=False` returns {} (skips their tiny tensor ops)."""
        metrics = {"context_size": torch.tensor(float(len(context)))} if with_metrics else {}
        if not context.is_ready:
            return None, metrics
        ctx_prompts = context.prompts
        self._fill(ctx_prompts + list(prompts))  # the backbone for prompts not held, on all threads
        self._feature_cache = {p: self._feature_cache[p] for p in ctx_prompts + list(prompts)}  # bounded
        kernel = isinstance(self.head, KernelHead)
        with _one_thread(kernel):  # [M, F] ops on a few hundred KB: waking a 2nd thread costs more than it saves
            x_ctx = self._context_features(context, ctx_prompts)  # [M, F] float64
            x_new = self.prompt_features(list(prompts)).double()  # [B, F]
            if kernel:
                search = self._search_now(context)
                self.head.fit(x_ctx, context.success_rate, context.counts, search=search)
                self._searched_at = context.total_added if search else self._searched_at
                if with_metrics:
                    metrics["bandwidth_searched"] = torch.tensor(float(search))
            else:
                self.head.fit(x_ctx, context.success_rate, context.counts)
            p_hat = self.head.predict(x_new).float().clamp(0, 1)  # [B]
        if with_metrics:
            metrics["p_hat_mean"] = p_hat.mean()
            if isinstance(self.head, KernelHead):
                metrics["bandwidth"] = self.head.bandwidth_.float()
        return p_hat, metrics
