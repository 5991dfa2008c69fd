"""HostStatePool: the host tier's state snapshot slots (memory/hybrid_tiered_cache.py), and the copies
between them and the device's StatePool (memory/state_pool.py) that a step's StatePlan queues
(``stores``: device state slots -> host slots; ``loads``: host slots -> device snapshot slots).

Same layout as StatePool, per linear layer (conv state in the model's dtype, delta state in float32),
slots from 0; each tensor-parallel rank holds its own heads' shard, as its StatePool does. Which slot
holds what is the radix cache's business (its host ``SnapshotSlots``).

The runner runs a step's stores, then its loads, before the step's other state copies
(model/state_step.py ``run_copies``), on the forward's stream:

* CPU: plain memory, plain indexed copies.
* CUDA: pinned memory. A store gathers the device rows (``index_select``) and copies them into a
  pinned buffer (``copy_(non_blocking=True)``), then waits for that copy (the stream's event) before
  it scatters the buffer into the host slots: a load of the same step may read a slot it fills, and
  the device slot it read may be rewritten by this step's loads, copies or forward. Stores are rare
  (one per snapshot the device pool evicts) and small beside a step. A load gathers the host slots
  into pinned memory, copies them to the device (``to(non_blocking=True)``) and scatters them there
  (``index_copy_``), in stream order before the copies and the forward that read them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from radixserve.scheduler.memory.state_pool import StatePool, StateShape


class HostStatePool:
    def __init__(self, shape: StateShape, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """``device``: the StatePool's device (CUDA: this pool's memory is pinned)."""
        self.device = device
        self.cuda = device.type == "cuda"
        conv = (slots, shape.conv_dim, shape.conv_width)
        delta = (slots, shape.heads, shape.k_dim, shape.v_dim)
        pin = self.cuda
        self.conv = [torch.zeros(conv, dtype=dtype, pin_memory=pin) for _ in range(shape.layers)]
        self.delta = [torch.zeros(delta, dtype=torch.float32, pin_memory=pin) for _ in range(shape.layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.conv, *self.delta]

    def store(self, pool: StatePool, pairs: npt.NDArray[np.int64]) -> None:
        """``pairs`` ``[state slots..., host slots...]``: the device slots' states into the host slots
        (distinct); landed when this returns."""
        if not len(pairs):
            return
        src, dst = (torch.from_numpy(np.ascontiguousarray(a)) for a in np.split(pairs, 2))
        src = src.to(self.device)
        staged = []
        for dev in [*pool.conv, *pool.delta]:
            rows = dev.index_select(0, src)
            if self.cuda:
                buf = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                buf.copy_(rows, non_blocking=True)
                rows = buf
            staged.append(rows)
        if self.cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()  # the buffers hold the states now
        for host, rows in zip(self._tensors(), staged, strict=True):
            host.index_copy_(0, dst, rows)

    def load(self, pool: StatePool, pairs: npt.NDArray[np.int64]) -> None:
        """``pairs`` ``[host slots..., device slots...]``: the host slots' states into the device slots
        (distinct), queued on the current stream."""
        if not len(pairs):
            return
        src, dst = (torch.from_numpy(np.ascontiguousarray(a)) for a in np.split(pairs, 2))
        dst = dst.to(self.device)
        for dev, host in zip([*pool.conv, *pool.delta], self._tensors(), strict=True):
            rows = host.index_select(0, src)
            if self.cuda:
                rows = rows.pin_memory().to(self.device, non_blocking=True)
            dev.index_copy_(0, dst, rows)
