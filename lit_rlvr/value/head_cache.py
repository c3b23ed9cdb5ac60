"""The kernel head's context columns, kept across steps: a ring buffer's records drop off one end and arrive at
the other, so `ValueModel` keeps the standardized columns of the records still held (`SlidingColumns`) when the
new context `continues` the held one."""

from __future__ import annotations

from torch import Tensor


def continues(held_start: int, held_prompts: list[str], start: int, prompts: list[str]) -> bool:
    """Do records [start, start + len(prompts)) continue the held records [held_start, …) of the same ring
    buffer, so the held rows of the records still in can be kept? (The kept records' prompts are checked.)"""
    held_end = held_start + len(held_prompts)
    return held_start <= start <= held_end <= start + len(prompts) and \
        held_prompts[start - held_start:] == prompts[: held_end - start]


class SlidingColumns:
    """Per-record columns ([D_i, M] each) of a ring buffer's records, as views of a window in [D_i, 2·capacity]
    buffers: dropping the oldest records moves the window's start and appending writes the new columns after
    its end, so a step costs its few new columns instead of a copy of all M (the window moves back to the
    buffers' start, one copy, each time it reaches their end)."""

    def __init__(self, columns: tuple[Tensor, ...], capacity: int) -> None:
        width = 2 * max(capacity, columns[0].shape[1])
        self.buffers = [c.new_empty(c.shape[0], width) for c in columns]  # [D_i, width] each
        self.start = self.end = 0
        self.append(columns)

    @classmethod
    def of(cls, zt: Tensor, sq_norm: Tensor, capacity: int) -> "SlidingColumns":
        """Standardized context columns zt [F, M] and their squared norms [M] (as a [1, M] row)."""
        return cls((zt, sq_norm.unsqueeze(0)), capacity)

    def views(self) -> tuple[Tensor, ...]:
        """[D_i, M] each: the held records' columns, oldest first."""
        return tuple(b[:, self.start:self.end] for b in self.buffers)

    def drop(self, count: int) -> None:
        self.start += count

    def append(self, columns: tuple[Tensor, ...]) -> None:
        """Columns [D_i, K] of K new records, after the held ones."""
        k, m = columns[0].shape[1], self.end - self.start
        if self.end + k > self.buffers[0].shape[1]:  # the window reached the end: move it back to the start
            for b in self.buffers:
                b[:, :m] = b[:, self.start:self.end].clone()  # the two ranges may overlap
            self.start, self.end = 0, m
        for b, c in zip(self.buffers, columns):
            b[:, self.end:self.end + k] = c
        self.end += k
