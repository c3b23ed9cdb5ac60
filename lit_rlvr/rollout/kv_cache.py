"""A KV cache that appends in place: transformers' `DynamicLayer` concatenates the whole cache with each new token,
so decoding T tokens copies O(T²) positions (27 % of the long workload's generation time, measured with
torch.profiler); this layer keeps its keys and values in a buffer that grows geometrically."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

MIN_SPARE = 64  # positions added at least when a buffer grows


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys`/`values` are views of the first `length` positions of a buffer [B, H, cap, D].

    An update writes the new positions into the buffer. A full buffer is reallocated with as many spare positions
    as it holds (at least `MIN_SPARE`), but never past the positions the layer can hold in all (its first update's
    plus `room`, the positions still to come): a few copies in all, never more than twice what the rows hold
    reserved, and never more than the last position needs. Selecting rows (shared prefill, finished rows leaving
    the batch) copies the kept rows' buffers."""

    is_croppable = False

    def __init__(self, room: int):
        super().__init__()
        self.room = room
        self.length = 0
        self._limit: Optional[int] = None  # positions in all: set by the first update
        self._buffers: Optional[tuple[Tensor, Tensor]] = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        end = self.length + key_states.shape[-2]
        if not self.is_initialized:
            self.device, self.is_initialized = key_states.device, True
        if self._limit is None:
            self._limit = end + self.room
        if self._buffers is None or end > self._buffers[0].shape[-2]:
            capacity = max(end, min(end + max(end, MIN_SPARE), self._limit))
            self._buffers = tuple(self._moved(states, capacity, fresh)
                                  for states, fresh in ((self.keys, key_states), (self.values, value_states)))
        keys, values = self._buffers
        keys[..., self.length : end, :] = key_states
        values[..., self.length : end, :] = value_states
        self.length = end
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def _moved(self, filled: Optional[Tensor], capacity: int, like: Tensor) -> Tensor:
        """A new buffer of `capacity` positions, rows and heads as `like`, holding `filled` (the first `length`
        positions, or nothing)."""
        buffer = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
        if self.length:
            buffer[..., : self.length, :] = filled
        return buffer

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: Tensor) -> None:
        if self._buffers is not None:
            # the kept rows' whole buffers in one copy: no temporary of the filled positions beside the old and
            # the new buffers (the spare positions copied are never read)
            self._buffers = tuple(b.index_select(0, indices.to(b.device)) for b in self._buffers)
            self.keys, self.values = (b[..., : self.length, :] for b in self._buffers)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("GrowingLayer is a sampling cache: it only appends and selects rows")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("GrowingLayer is a sampling cache: it only appends and selects rows")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def reset(self) -> None:
        self.length, self._buffers, self._limit = 0, None, None
        super().reset()


def growing_cache(config, room: int) -> Cache:
    """The cache transformers would build for `config`, its full-attention layers replaced by `GrowingLayer`s with
    `room` positions to come (sliding-window, linear-attention and other layer types keep their own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def can_select_rows(cache: Optional[Cache]) -> bool:
    """Whether every layer of `cache` can drop batch rows (a linear-attention state, for one, cannot)."""
    return cache is None or all(hasattr(layer, "batch_select_indices") for layer in cache.layers)
