"""Host -> device transfers of a step's small int64 arrays: one copy per call, never a stall.

On CUDA a copy from ordinary (pageable) host memory blocks the host until the device has taken it,
and ten such copies a step cost more host time than the step's kernels take to run. ``Staging``
packs the arrays into one pinned host buffer and issues one ``non_blocking`` copy on the current
stream; the device views it returns are ready in stream order. A pinned buffer may be refilled only
after the copy that reads it has run, so buffers rotate through a small ring, each with an event
recorded after its copy; reusing one waits on its event (in practice long done).

On CPU nothing moves: the views share memory with a fresh host array (``torch.from_numpy``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device, ring: int = 4, initial: int = 1 << 14) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copies = 0  # host->device copies issued (tests count them)
        if self.cuda:
            self._bufs = [torch.empty(initial, dtype=torch.int64, pin_memory=True) for _ in range(ring)]
            self._events: list[torch.cuda.Event | None] = [None] * ring
            self._next = 0

    def send(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """int64 device tensors with the contents of ``arrays`` (any integer dtype), one per array."""
        sizes = [len(a) for a in arrays]
        total = sum(sizes)
        if not self.cuda:
            flat = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False)) if arrays else None
            dev = flat if flat is not None else torch.empty(0, dtype=torch.int64)
        else:
            i = self._next
            self._next = (i + 1) % len(self._bufs)
            event = self._events[i]
            if event is not None:
                event.synchronize()  # the copy that last read this buffer has run
            if len(self._bufs[i]) < total:
                self._bufs[i] = torch.empty(
                    max(total, 2 * len(self._bufs[i])), dtype=torch.int64, pin_memory=True
                )
            host = self._bufs[i][:total]
            if total:
                np.concatenate(arrays, out=host.numpy(), casting="unsafe")
            dev = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events[i] = event
        self.copies += 1
        return list(dev.split(sizes))
