"""ReqToTokenPool: for each running request, the KV slot of every token it holds.

A ``[max_running + 1, max_context]`` int32 table on the host. Row ``r`` column ``i`` is the KV
slot of token ``i`` of the request that owns row ``r``. The scheduler reads and writes it
without touching the device; the attention backends turn the rows of a step's requests
into device metadata once per step, in ``prepare`` (model/attention/).

The last row, ``scratch_row``, is never handed out and stays all zeros: slot 0 is the allocator's
scratch page. Padding entries of a padded decode batch (the CUDA-graph buckets) name it, so they
attend over one slot that no request owns and write their K/V there.

Device mirror (``attach_device``). On a GPU the flashinfer backend builds each step's page list
on the device from a copy of the table, so the host sends O(batch) numbers per step instead of
every page of every context. The mirror is updated incrementally: writes are logged on the host,
the runner sends everything written since the last step in its one staged host->device copy
(``take_pending``) and scatters it into the mirror (``apply_pending``) before the step that reads
it. On CPU the mirror is the host array itself (a zero-copy view), so there is nothing to sync.

Tensor parallelism: only rank 0 has a scheduler that writes the table. It logs its writes
(``log_writes``) and sends each step's ``take_pending`` array with the step; the other ranks
``replay`` it into their own table (and their mirror) before the step, so every rank's attention
reads the same slots.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


class ReqToTokenPool:
    def __init__(self, max_running: int, max_context: int) -> None:
        if max_running < 1 or max_context < 1:
            raise ValueError("max_running and max_context must be >= 1")
        self.max_running = max_running
        self.max_context = max_context
        self.scratch_row = max_running
        self.host = np.zeros((max_running + 1, max_context), dtype=np.int32)
        self._free_rows = list(range(max_running - 1, -1, -1))
        self._row_free = np.ones(max_running, dtype=bool)
        self.device_table: torch.Tensor = torch.from_numpy(self.host)  # the mirror (CPU: this array)
        # (rows, cols) written since the last sync
        self._log: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] | None = None

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
        if row == self.scratch_row or self._row_free[row]:
            raise ValueError(f"double free of request slot {row}")
        self._row_free[row] = True
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: npt.NDArray[np.integer]) -> None:
        """Set the slots of tokens ``[start, start + len(slots))`` of ``row``."""
        end = start + len(slots)
        if end > self.max_context:
            raise ValueError(f"context {end} exceeds max_context {self.max_context}")
        self.host[row, start:end] = slots
        if self._log is not None and end > start:
            self._log.append(
                (np.full(end - start, row, dtype=np.int64), np.arange(start, end, dtype=np.int64))
            )

    def write_tokens(
        self, rows: npt.NDArray[np.integer], cols: npt.NDArray[np.integer], slots: npt.NDArray[np.integer]
    ) -> None:
        """Scatter one slot per (row, col): the decode step's write, one call per batch."""
        self.host[rows, cols] = slots
        if self._log is not None and len(rows):
            self._log.append((np.asarray(rows, np.int64), np.asarray(cols, np.int64)))

    def read(self, row: int, start: int, end: int) -> npt.NDArray[np.int64]:
        return self.host[row, start:end].astype(np.int64)

    # ------------------------------------------------------------------ device mirror
    def attach_device(self, device: torch.device) -> None:
        """Keep a copy of the table on ``device`` (CUDA); a no-op on CPU."""
        if device.type == "cpu":
            return
        self.device_table = torch.from_numpy(self.host).to(device)
        self._log = []

    def log_writes(self) -> None:
        """Log writes for ``take_pending`` even without a device mirror (rank 0 of a TP group)."""
        if self._log is None:
            self._log = []

    @property
    def mirrored(self) -> bool:
        """The device table is a copy that ``apply_pending`` must keep up to date."""
        return self.device_table.device.type != "cpu"

    def replay(self, packed: npt.NDArray[np.int64]) -> None:
        """Write a ``take_pending`` array of another rank's table into this one's host table."""
        rows, cols, slots = np.split(packed, 3)
        self.host[rows, cols] = slots

    def take_pending(self) -> npt.NDArray[np.int64] | None:
        """Every write since the last call as one int64 array ``[rows, cols, slots]`` to send to the
        device (None: nothing to send, or no mirror). Slots are read now, not at write time, so a
        cell written twice sends its latest slot both times."""
        if not self._log:
            return None
        rows, cols = (np.concatenate(part) for part in zip(*self._log, strict=True))
        self._log.clear()
        return np.concatenate([rows, cols, self.host[rows, cols].astype(np.int64)])

    def apply_pending(self, packed: torch.Tensor) -> None:
        """Scatter a ``take_pending`` array, now on the mirror's device, into the mirror (one op, on
        the caller's stream: before the step that reads it)."""
        rows, cols, slots = packed.chunk(3)
        self.device_table.index_put_((rows, cols), slots.to(torch.int32))

    def page_indices(
        self, rows: torch.Tensor, page_indptr: torch.Tensor, total_pages: int, page_size: int
    ) -> torch.Tensor:
        """Every page of every listed row, concatenated, read from the device mirror with a few
        vectorised ops (no host sync, no per-request work): row ``i`` contributes its pages
        ``0 .. page_indptr[i + 1] - page_indptr[i] - 1``, i.e. the slots at columns 0, page_size, ...
        divided by page_size. ``rows`` and ``page_indptr`` (int64, [B] and [B + 1]) live on the
        mirror's device; returns int32 [total_pages]."""
        dev = self.device_table.device
        k = torch.arange(total_pages, dtype=torch.int64, device=dev)
        # which entry each output page belongs to: the last i with page_indptr[i] <= k
        entry = torch.searchsorted(page_indptr.narrow(0, 1, len(page_indptr) - 1), k, right=True)
        cols = (k - page_indptr.index_select(0, entry)) * page_size
        flat = rows.index_select(0, entry) * self.max_context + cols
        slots = self.device_table.view(-1).index_select(0, flat)
        return slots // page_size if page_size > 1 else slots
