"""`ValueModel`: V0's backbone → adapter → head, fit in context (the package docstring has the whole story)."""

from __future__ import annotations

import contextlib
import inspect
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import Tensor

from lit_rlvr.value.adapter import ResidualQueryAdapter, load_adapter
from lit_rlvr.value.backbone import CachedBackbone, EmbeddingBackbone, mean_pool
from lit_rlvr.value.buffer import ContextBuffer
from lit_rlvr.value.head_cache import SlidingColumns, continues
from lit_rlvr.value.heads import KernelHead, TabPFNHead

Head = Union[KernelHead, TabPFNHead]
FEATURE_MODES = ("auto", "adapter", "pooled")
HEADS = {"kernel": KernelHead, "tabpfn": TabPFNHead}


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
        self._columns: Optional[tuple[int, list[str], int, SlidingColumns]] = None  # see _context_standardized
        self._last_batch: Optional[tuple[list[str], int, Tensor, Tensor]] = None  # see _standardized
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
        head_kwargs = dict(head_kwargs or {})
        accepts = inspect.signature(HEADS[head]).parameters
        if "device" in accepts:  # TabPFN: on the value model's device and seeded by it, unless head_kwargs say
            head_kwargs.setdefault("device", device)
        if "random_state" in accepts:
            head_kwargs.setdefault("random_state", seed)
        return cls(bb, HEADS[head](**head_kwargs), adapter=adapter, features=features, seed=seed,
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
        """Put the features of `prompts` in the cache (kept with the context from here on)."""
        self._feature_cache.update(self._features_of(prompts))

    def _hold(self, prompts: list[str]) -> None:
        """Make the feature cache hold exactly `prompts`' features (bounded: the context's and this step's)."""
        self._feature_cache = self._features_of(prompts)

    def _features_of(self, prompts: list[str]) -> dict[str, Tensor]:
        """{prompt: [F] features}: cached, else computed ahead, else by the backbone now (one call for all)."""
        cache, ahead = self._feature_cache, self._precomputed
        held = {p: cache[p] if p in cache else ahead.get(p) for p in prompts}
        missing = [p for p, row in held.items() if row is None]
        if missing:
            held.update(zip(missing, self.features(missing)))
        return held

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
            if self.head.load_geometry(state["geometry"]) is not False:  # False: an older state, search anew
                self._searched_at = int(state["searched_at"])

    def _context_standardized(self, context: ContextBuffer, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """The kernel head's standardized context rows as columns [F, M] and their squared norms [M], in its
        current geometry. A row depends on its record alone, and the context (a ring buffer) gains a few records
        per step: the columns of the records still in are kept, the new records' standardized and appended."""
        start = context.total_added - len(prompts)  # records [start, total_added) are in the context
        held = self._columns  # (start, prompts, geometry, columns) of the last call, or None
        if held is None or held[2] != self.head.geometry_id or not continues(held[0], held[1], start, prompts):
            z, sq_norm = self.head.standardize(self.prompt_features(prompts))  # [M, F], [M]
            return self._set_columns(context, prompts, SlidingColumns.of(z.T, sq_norm, context.capacity))
        columns = held[3]
        columns.drop(start - held[0])
        fresh = prompts[held[0] + len(held[1]) - start:]  # the records added since
        if fresh:
            z, sq_norm = self._standardized(fresh)  # [K, F], [K]
            columns.append((z.T, sq_norm.unsqueeze(0)))
        return self._set_columns(context, prompts, columns)

    def _standardized(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """The kernel head's `standardize` of the prompts' features, [B, F] and [B]. The records a step adds are
        usually the prompts it predicted: their rows from that prediction are reused (same geometry, and a row
        depends on its prompt alone: the same bits)."""
        last = self._last_batch  # (prompts, geometry, z, sq_norm) of the last prediction, or None
        if last is not None and last[0] == prompts and last[1] == self.head.geometry_id:
            return last[2], last[3]
        z, sq_norm = self.head.standardize(self.prompt_features(prompts))
        self._last_batch = (prompts, self.head.geometry_id, z, sq_norm)
        return z, sq_norm

    def _set_columns(self, context: ContextBuffer, prompts: list[str],
                     columns: "SlidingColumns") -> tuple[Tensor, Tensor]:
        """Hold `columns` as the context's standardized columns (the next steps' start); their views [F, M], [M]."""
        self._columns = (context.total_added - len(prompts), prompts, self.head.geometry_id, columns)
        zt, sq_norm = columns.views()  # [F, M], [1, M]
        return zt, sq_norm[0]

    def _search_now(self, context: ContextBuffer) -> bool:
        """Search the kernel bandwidth at this fit? Yes the first time and once `bandwidth_refit` of the
        context is new since the last search (always, with bandwidth_refit = 0)."""
        if self._searched_at is None or getattr(self.head, "bandwidth_", None) is None:
            return True
        return context.total_added - self._searched_at >= self.bandwidth_refit * len(context)

    def _fit_kernel(self, context: ContextBuffer, ctx_prompts: list[str]) -> bool:
        """Fit the kernel head on the context: a new geometry from the raw features when `_search_now`, else
        the held geometry on the context's standardized rows (only the new records' are computed). Returns
        whether it searched."""
        search = self._search_now(context)
        if search:  # a new geometry, from the raw features
            x = self.prompt_features(ctx_prompts).double()  # [M, F] float64
            self.head.fit(x, context.success_rate, context.counts)
            self._searched_at = context.total_added
            columns = SlidingColumns.of(self.head.zt_, self.head.sq_norm_, context.capacity)
            zt, sq_norm = self._set_columns(context, ctx_prompts, columns)
        else:  # the held geometry: only the new records are standardized
            zt, sq_norm = self._context_standardized(context, ctx_prompts)
        # the same column layout at every step (what the matmul reads decides its last bits)
        self.head.fit_standardized(zt, sq_norm, context.success_rate, context.counts)
        return search

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
        self._hold(ctx_prompts + list(prompts))  # the backbone for prompts not held, on all threads
        kernel = isinstance(self.head, KernelHead)
        with _one_thread(kernel):  # [M, F] ops on a few hundred KB: waking a 2nd thread costs more than it saves
            if kernel:
                search = self._fit_kernel(context, ctx_prompts)
                if with_metrics:
                    metrics["bandwidth_searched"] = torch.tensor(float(search))
                p_hat = self.head.predict_standardized(*self._standardized(list(prompts)))  # [B] float64
            else:
                self.head.fit(self.prompt_features(ctx_prompts).double(), context.success_rate, context.counts)
                p_hat = self.head.predict(self.prompt_features(list(prompts)))  # [B]
            p_hat = p_hat.float().clamp(0, 1)  # [B]
        if with_metrics:
            metrics["p_hat_mean"] = p_hat.mean()
            if isinstance(self.head, KernelHead):
                metrics["bandwidth"] = self.head.bandwidth_.float()
        return p_hat, metrics
