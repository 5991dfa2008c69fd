"""HostStatePool: the host tier's state snapshot slots (memory/hybrid_tiered_cache.py), and the copies
between them and the device's StatePool (memory/state_pool.py) that a step's StatePlan queues
(``stores``: device state slots -> host slots; ``loads``: host slots -> device snapshot slots).

Same layout as StatePool, per linear layer (conv state in the model's dtype, delta state in float32),
slots from 0; each tensor-parallel rank holds its own heads' shard, as its StatePool does. Which slot
holds what is the radix cache's business (its host ``SnapshotSlots``).

The runner runs a step's stores, then its loads, before the step's other state copies
(model/state_step.py ``run_copies``), on the forward's stream:

* CPU: plain memory, plain indexed copies.
* CUDA: pinned memory, and no wait on the host for the device (the step's forward may still be
  running: the scheduler plans the next step meanwhile). A store gathers the device rows and queues
  their copy into pinned buffers with an event; the buffers are scattered into the host slots at
  the next store or load (after the event), so a load of a slot a store filled reads what it
  stored, and a slot a later store reuses gets the later state. A load gathers the host slots into
  pinned buffers and queues their copy to the device and the scatter there (``index_copy_``), in
  stream order before the copies and the forward that read them. Slot indices go over pinned and
  non-blocking, as the host KV pool's do.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from radixserve.scheduler.memory.kv_pool import gather_slots, scatter_slots, slot_index, slots_to_device
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
        self.tensors = [*self.conv, *self.delta]
        # CUDA: the last stores' (transfer done, pinned buffers, host slots), not scattered yet
        self._landing: tuple[torch.cuda.Event, list[torch.Tensor], torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def store(self, pool: StatePool, pairs: npt.NDArray[np.int64]) -> None:
        """``pairs`` ``[state slots..., host slots...]``: the device slots' states into the host slots
        (distinct); on CUDA they land at the next store or load (``land``)."""
        if not len(pairs):
            return
        src, dst = np.split(pairs, 2)
        device_tensors = [*pool.conv, *pool.delta]
        if not self.cuda:
            scatter_slots(self.tensors, slot_index(dst), gather_slots(device_tensors, slot_index(src)))
            return
        self.land()  # an earlier step's stores first: this one may fill the same slots
        staged = []
        for rows in gather_slots(device_tensors, slots_to_device(src, self.device)):
            buf = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            buf.copy_(rows, non_blocking=True)
            staged.append(buf)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._landing = (done, staged, slot_index(dst))

    def load(self, pool: StatePool, pairs: npt.NDArray[np.int64]) -> None:
        """``pairs`` ``[host slots..., device slots...]``: the host slots' states into the device slots
        (distinct), queued on the current stream."""
        if not len(pairs):
            return
        self.land()  # a slot a store of this step or an earlier one fills
        src, dst = np.split(pairs, 2)
        device_tensors = [*pool.conv, *pool.delta]
        if not self.cuda:
            scatter_slots(device_tensors, slot_index(dst), gather_slots(self.tensors, slot_index(src)))
            return
        host_rows = []
        for t in self.tensors:
            buf = torch.empty((len(src), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
            torch.index_select(t, 0, slot_index(src), out=buf)
            host_rows.append(buf.to(self.device, non_blocking=True))
        scatter_slots(device_tensors, slots_to_device(dst, self.device), host_rows)

    def land(self) -> None:
        """Scatter the last stores into the host slots, once their transfer is done (CUDA)."""
        if self._landing is None:
            return
        done, staged, dst = self._landing
        self._landing = None
        done.synchronize()
        scatter_slots(self.tensors, dst, staged)
