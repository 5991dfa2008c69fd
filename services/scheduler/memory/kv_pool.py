"""KVPool: the K and V tensors of every layer, indexed by KV slot; and the copies of slots' rows
between such tensors (the host pool's and the disk tier's: memory/host_pool.py, memory/disk_tier.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
import torch


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # index_put_ rather than ``k[slots] = ...``: the same kernel, without Python's indexing path
        self.k[layer].index_put_((slots,), k)
        self.v[layer].index_put_((slots,), v)


def gather_slots(tensors: Sequence[torch.Tensor], slots: torch.Tensor) -> Iterator[torch.Tensor]:
    """Rows ``slots`` of each of ``tensors`` (a pool's K of every layer, then V), one tensor at a
    time: a copy into another pool holds one layer's rows at once; ``torch.stack`` them for one
    ``[2L, n, heads, dim]`` tensor."""
    return (t.index_select(0, slots) for t in tensors)


def scatter_slots(tensors: Sequence[torch.Tensor], slots: torch.Tensor, rows: Iterable[torch.Tensor]) -> None:
    """Write ``rows`` (one ``[n, heads, dim]`` per tensor: ``gather_slots``'s, or a stacked tensor's
    first axis) into rows ``slots`` of each of ``tensors``."""
    for t, r in zip(tensors, rows, strict=True):
        t.index_copy_(0, slots, r)


def slot_index(slots: npt.NDArray[np.int64]) -> torch.Tensor:
    """Slot numbers as the int64 tensor the copies index with (on the host, sharing the array)."""
    return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))


def slots_to_device(slots: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
    """``slot_index`` on ``device``: pinned, then a non-blocking copy (a pageable one would wait for
    the device's queued work, the previous step's forward included)."""
    return slot_index(slots).pin_memory().to(device, non_blocking=True)
