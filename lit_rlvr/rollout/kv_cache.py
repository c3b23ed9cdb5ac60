"""A KV cache that appends in place: transformers' `DynamicLayer` concatenates the whole cache with each new token,
so decoding T tokens copies O(T²) positions (27 % of the long workload's generation time, measured with
torch.profiler); this layer keeps its keys and values in a buffer with room for the tokens still to come."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys`/`values` are views of the first `length` positions of a buffer [B, H, cap, D].
    An update writes the new positions into the buffer; it reallocates (with `room` spare positions) only when
    full. Batch selection (shared prefill, finished rows leaving the batch) selects the buffer's rows."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room
        self.length = 0
        self._buffers: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._buffers is None or end > self._buffers[0].shape[-2]:
            self._buffers = tuple(self._grown(old, fresh, end + self.room)
                                  for old, fresh in ((self.keys, key_states), (self.values, value_states)))
        keys, values = self._buffers
        keys[..., self.length : end, :] = key_states
        values[..., self.length : end, :] = value_states
        self.length = end
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def _grown(self, old: Tensor, fresh: Tensor, capacity: int) -> Tensor:
        buffer = fresh.new_empty((*fresh.shape[:-2], capacity, fresh.shape[-1]))
        if self.length:
            buffer[..., : self.length, :] = old
        return buffer

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: Tensor) -> None:
        if self._buffers is not None:
            self._buffers = tuple(b.index_select(0, indices.to(b.device)) for b in self._buffers)
            self.keys, self.values = (b[..., : self.length, :] for b in self._buffers)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("GrowingLayer is a sampling cache: it only appends and selects rows")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("GrowingLayer is a sampling cache: it only appends and selects rows")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def reset(self) -> None:
        self.length, self._buffers = 0, None
        super().reset()


def growing_cache(num_layers: int, room: int) -> Cache:
    """An empty cache of `num_layers` `GrowingLayer`s, each with `room` spare positions when it grows."""
    return Cache(layers=[GrowingLayer(room) for _ in range(num_layers)])
