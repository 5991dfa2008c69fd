"""ReqToTokenPool: for each running request, the KV slot of every token it holds.

A ``[max_running, max_context]`` int32 table on the host. Row ``r`` column ``i`` is the KV
slot of token ``i`` of the request that owns row ``r``. The scheduler reads and writes it
without touching the device; the attention backends turn the rows of a step's requests
into device metadata once per step, in ``prepare`` (model/attention.py).
"""

from __future__ import annotations

import numpy as np


class ReqToTokenPool:
    def __init__(self, max_running: int, max_context: int) -> None:
        if max_running < 1 or max_context < 1:
            raise ValueError("max_running and max_context must be >= 1")
        self.max_running = max_running
        self.max_context = max_context
        self.host = np.zeros((max_running, max_context), dtype=np.int32)
        self._free_rows = list(range(max_running - 1, -1, -1))
        self._row_free = np.ones(max_running, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request slot")
        row = self._free_rows.pop()
        self._row_free[row] = False
        return row

    def free(self, row: int) -> None:
        if self._row_free[row]:
            raise ValueError(f"double free of request slot {row}")
        self._row_free[row] = True
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        """Set the slots of tokens ``[start, start + len(slots))`` of ``row``."""
        end = start + len(slots)
        if end > self.max_context:
            raise ValueError(f"context {end} exceeds max_context {self.max_context}")
        self.host[row, start:end] = slots

    def write_tokens(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """Scatter one slot per (row, col): the decode step's write, one call per batch."""
        self.host[rows, cols] = slots

    def read(self, row: int, start: int, end: int) -> np.ndarray:
        return self.host[row, start:end].astype(np.int64)
