"""V0 residual query adapter: token states → a fixed-size feature vector per prompt (docs/architecture.md §6).

K learnable static queries, plus a per-prompt residual offset generated from the mean-pooled embedding by a
small MLP whose last layer starts at zero (so at init every prompt is read by the same static queries);
multi-head attention of the queries over the projected token states; the K outputs of `width` each are
flattened to K·width features (paper: K = 168, width 6, 3 heads → 1008 features for the TabPFN head).

Shapes: B prompts, L tokens, D = d_in, K queries, W = width, H heads, W/H per head.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlvr.value.backbone import mean_pool


class ResidualQueryAdapter(nn.Module):
    """Residual query adapter. `forward(states [B, L, D], mask [B, L]) -> features [B, K·W]`.

    Init is deterministic given `seed` (it uses its own generator, not the global RNG).
    """

    def __init__(
        self, d_in: int, num_queries: int = 168, width: int = 6, heads: int = 3, hidden: int = 256, seed: int = 0
    ) -> None:
        super().__init__()
        if width % heads != 0:
            raise ValueError(f"ResidualQueryAdapter: width ({width}) must be divisible by heads ({heads})")
        self.config = dict(d_in=d_in, num_queries=num_queries, width=width, heads=heads, hidden=hidden)
        self.num_queries, self.width, self.heads = num_queries, width, heads
        self.norm = nn.LayerNorm(d_in)  # backbones differ in scale; attention logits should not
        self.queries = nn.Parameter(torch.empty(num_queries, width))  # [K, W] static queries
        self.offset = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, num_queries * width))
        self.key = nn.Linear(d_in, width)
        self.value = nn.Linear(d_in, width)
        self.out = nn.Linear(width, width)
        self.reset_parameters(seed)

    @property
    def num_features(self) -> int:
        return self.num_queries * self.width

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        for module in (self.offset[0], self.key, self.value, self.out):
            bound = 1 / math.sqrt(module.in_features)  # torch's default Linear scale, seeded
            module.weight.copy_(torch.empty_like(module.weight).uniform_(-bound, bound, generator=g))
            module.bias.zero_()
        self.queries.copy_(torch.randn(self.queries.shape, generator=g))
        self.offset[2].weight.zero_()  # residual starts at zero: queries are static at init
        self.offset[2].bias.zero_()
        self.norm.reset_parameters()

    def forward(self, states: Tensor, mask: Tensor) -> Tensor:
        b, length, _ = states.shape
        h, dh = self.heads, self.width // self.heads
        x = self.norm(states)  # [B, L, D]
        pooled = mean_pool(x, mask)  # [B, D]
        q = self.queries + self.offset(pooled).view(b, self.num_queries, self.width)  # [B, K, W]
        q = q.view(b, self.num_queries, h, dh).transpose(1, 2)  # [B, H, K, W/H]
        k = self.key(x).view(b, length, h, dh).transpose(1, 2)  # [B, H, L, W/H]
        v = self.value(x).view(b, length, h, dh).transpose(1, 2)  # [B, H, L, W/H]
        att_mask = mask[:, None, None, :]  # [B, 1, 1, L] True = attend
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=att_mask)  # [B, H, K, W/H]
        y = y.transpose(1, 2).reshape(b, self.num_queries, self.width)  # [B, K, W]
        return self.out(y).flatten(1)  # [B, K·W]


def save_adapter(adapter: ResidualQueryAdapter, path: str | Path) -> None:
    """Write {"config", "state_dict"}; `load_adapter` reads it back."""
    torch.save({"config": dict(adapter.config), "state_dict": adapter.state_dict()}, str(path))


def load_adapter(path: str | Path, *, heads: int = 3, map_location: str | torch.device = "cpu") -> ResidualQueryAdapter:
    """Load adapter weights: our {"config", "state_dict"} file, or a bare state dict (shapes give d_in, K,
    width and hidden; `heads` cannot be read from shapes, so it is an argument). `.safetensors` works too
    (bare state dict). The paper's released V0 format is not public to us; convert its keys to these.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"adapter weights not found: {path} (set the value model's adapter_path)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        blob: Any = load_file(str(path), device=str(map_location))
    else:
        blob = torch.load(str(path), map_location=map_location, weights_only=True)
    if "config" in blob and "state_dict" in blob:
        config, state = dict(blob["config"]), blob["state_dict"]
    else:
        state = blob
        num_queries, width = state["queries"].shape
        hidden, d_in = state["offset.0.weight"].shape
        config = dict(d_in=d_in, num_queries=num_queries, width=width, heads=heads, hidden=hidden)
    adapter = ResidualQueryAdapter(**config)
    adapter.load_state_dict(state)
    return adapter.eval()
