"""V0 context: the current policy's most recent (prompt, success rate, n) records (docs/architecture.md §6).

The head is fit on this set at every step, so it describes the policy as it is now. Records are kept in
arrival order; a prompt seen again is a new record (the policy has changed since), and the oldest records
drop out once `capacity` is reached. Until `min_context` records are held the prior is "absent".
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import torch
from torch import Tensor


class ContextBuffer:
    """Ring buffer of (prompt, success_rate in [0, 1], n rollouts) records.

    `min_context` default 32 *(inferred)*: the paper's context is 256 records; below a few dozen the kernel
    bandwidth and TabPFN's in-context fit are too noisy to trust.
    """

    def __init__(self, capacity: int = 256, min_context: int = 32) -> None:
        if capacity < 1 or not 1 <= min_context <= capacity:
            raise ValueError(
                f"ContextBuffer needs capacity ≥ 1 and 1 ≤ min_context ≤ capacity; got capacity={capacity}, "
                f"min_context={min_context}"
            )
        self.capacity = capacity
        self.min_context = min_context
        self._records: deque[tuple[str, float, int]] = deque(maxlen=capacity)
        self.total_added = 0  # records ever added: how much of the context is new since some earlier moment
        self._columns: dict[str, Any] = {}  # prompts / success_rate / counts, built once per change

    def __len__(self) -> int:
        return len(self._records)

    @property
    def is_ready(self) -> bool:
        return len(self._records) >= self.min_context

    def add(
        self, prompts: Sequence[str], success_rate: Tensor | Sequence[float], counts: Tensor | Sequence[int]
    ) -> None:
        """Append B records. `success_rate` [B] in [0, 1] (on ±1 rewards: (mean + 1) / 2), `counts` [B] ≥ 1.

        Records with n = 0 carry no information and are skipped. (One host sync per step: the records are
        plain Python so the buffer pickles into a checkpoint as is.)
        """
        rates, ns = _as_list(success_rate, torch.float64), _as_list(counts, torch.long)
        if not len(prompts) == len(rates) == len(ns):
            raise ValueError(f"ContextBuffer.add: {len(prompts)} prompts, {len(rates)} rates, {len(ns)} counts")
        added = [(prompt, rate, n) for prompt, rate, n in zip(prompts, rates, ns) if n > 0]
        for prompt, rate, _ in added:
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"ContextBuffer.add: success rate must be in [0, 1], got {rate} for {prompt!r}")
        self._records.extend(added)
        self.total_added += len(added)
        self._extend_columns(added)

    def _extend_columns(self, added: list[tuple[str, float, int]]) -> None:
        """Bring built columns up to date: the new records' rows appended, the dropped ones cut (a few rows,
        not M: the head reads the columns at every step). The same values as building them anew."""
        if not self._columns or not added:
            return
        fresh = self._build_columns(added[-len(self._records):])  # more added than the capacity: the last kept
        old = len(self._records) - len(fresh["prompts"])  # rows of the built columns still in the buffer
        join = lambda a, b: a + b if isinstance(a, list) else torch.cat([a, b])  # noqa: E731
        self._columns = {name: join(col[len(col) - old:], fresh[name]) for name, col in self._columns.items()}

    @property
    def prompts(self) -> list[str]:
        """[M] prompt texts (a fresh list)."""
        return list(self._column("prompts"))

    @property
    def success_rate(self) -> Tensor:
        """[M] float32 (built once per change of the buffer: do not modify it in place)."""
        return self._column("success_rate")

    @property
    def counts(self) -> Tensor:
        """[M] long (built once per change of the buffer: do not modify it in place)."""
        return self._column("counts")

    def _column(self, name: str) -> Any:
        if not self._columns:
            self._columns = self._build_columns(self._records)
        return self._columns[name]

    @staticmethod
    def _build_columns(records: Sequence[tuple[str, float, int]]) -> dict[str, Any]:
        prompts, rates, counts = zip(*records) if records else ((), (), ())
        return {"prompts": list(prompts), "success_rate": torch.tensor(rates, dtype=torch.float32),
                "counts": torch.tensor(counts, dtype=torch.long)}

    def clear(self) -> None:
        self._records.clear()
        self.total_added = 0
        self._columns = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "min_context": self.min_context,
            "prompts": self.prompts,
            "success_rate": [r[1] for r in self._records],
            "counts": [r[2] for r in self._records],
            "total_added": self.total_added,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the records; the buffer keeps its own capacity (the newest records win if it shrank)."""
        self._records.clear()
        for record in zip(state["prompts"], state["success_rate"], state["counts"]):
            self._records.append((str(record[0]), float(record[1]), int(record[2])))
        self.total_added = int(state.get("total_added", len(self._records)))
        self._columns = {}


def _as_list(values: Tensor | Sequence, dtype: torch.dtype) -> list:
    """[B] values as a Python list of `dtype`'s kind (floats in float64: no rounding)."""
    if isinstance(values, Tensor):
        return values.detach().to("cpu", dtype).tolist()
    kind = float if dtype.is_floating_point else int
    return [kind(v) for v in values]
