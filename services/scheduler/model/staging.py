"""Host -> device transfers of a step's small arrays: one copy per call, never a stall.

On CUDA a copy from ordinary (pageable) host memory blocks the host until the device has taken it,
and ten such copies a step cost more host time than the step's kernels take to run. ``to_device``
copies through pinned memory with ``non_blocking``: the copy is queued on the current stream and
the host goes on. The pinned block comes from torch's caching host allocator, which records an
event on it at the copy and hands it out again only after that event, so a block is never refilled
while a copy still reads it. ``Staging.send`` packs a step's int64 arrays into one such copy.

On CPU nothing moves: the result shares memory with the host array.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the host tensor the copy reads, its device copy); on CPU both are ``host`` itself."""
    if device.type == "cpu":
        return host, host
    if device.type == "cuda":
        host = host.pin_memory()
    return host, host.to(device, non_blocking=True)


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copies = 0  # host->device copies issued (tests count them)

    def send(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """int64 device tensors with the contents of ``arrays`` (any integer dtype), one per array."""
        flat = np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, np.int64)
        _, dev = to_device(torch.from_numpy(flat), self.device)
        self.copies += 1
        return list(torch.split(dev, [len(a) for a in arrays]))
