"""Paged KV slot allocator: who may write which KV slot.

The KV pool is a flat array of token slots grouped into pages of ``page_size``
slots; page ``p`` owns slots ``[p * page_size, (p + 1) * page_size)``. Page 0 is
reserved as a scratch page (padded batch entries write there), so the pool holds
``num_pages + 1`` pages of which ``num_pages`` are ever handed out.

Free pages live in a fixed array used as a stack: alloc and free move a slice,
O(1) per page and vectorised. A boolean ``is_free`` mirror turns a double free or
a free of a never-allocated page into an immediate error instead of silent
corruption (two owners of one page).
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt
import torch


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PagedAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Stack of free page ids; an allocation takes the slice below _top. Starting in ascending
        # order, a fresh pool hands a request consecutive pages: its KV is contiguous in memory,
        # which the attention backends' gathers read much faster than scattered pages.
        self.reset()

    def reset(self) -> None:
        """Every page free again (its owners are gone: a cache dropping all its nodes)."""
        n = self.num_pages
        self._stack = np.arange(n, 0, -1, dtype=np.int64)
        self._top = n
        self._is_free = np.ones(n + 1, dtype=bool)
        self._is_free[0] = False  # scratch page, never handed out

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._top

    @property
    def free_tokens(self) -> int:
        return self._top * self.page_size

    @property
    def pool_slots(self) -> int:
        """Slots the KV tensors must have (scratch page included)."""
        return (self.num_pages + 1) * self.page_size

    # ------------------------------------------------------------- alloc/free
    def alloc_pages(self, n: int) -> npt.NDArray[np.int64]:
        """Take ``n`` free pages; returns their ids (int64)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            raise OutOfPagesError(f"asked for {n} pages, {self._top} free")
        pages = self._stack[self._top - n : self._top][::-1].copy()  # ascending from a fresh pool
        self._top -= n
        self._is_free[pages] = False
        return pages

    def free_pages(self, pages: npt.NDArray[np.integer]) -> None:
        """Return pages to the pool. Raises on a double free or a foreign page."""
        n = len(pages)
        if n == 0:
            return
        ids = np.asarray(pages, dtype=np.int64)
        if ids.min() < 1 or ids.max() > self.num_pages:
            raise ValueError("free of a page outside the pool")
        if self._is_free[ids].any() or len(np.unique(ids)) != n:
            raise ValueError("double free of a KV page")
        self._is_free[ids] = True
        self._stack[self._top : self._top + n] = ids
        self._top += n

    def free_slots(self, slots: npt.NDArray[np.integer]) -> None:
        """Free the pages that a page-aligned run of slots covers."""
        if len(slots) == 0:
            return
        ps = self.page_size
        if ps == 1:
            self.free_pages(slots)
        else:
            self.free_pages(np.asarray(slots[::ps]) // ps)

    def pages_to_slots(self, pages: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """All slots of the given pages, in order."""
        ps = self.page_size
        if ps == 1:
            return pages
        return (pages[:, None] * ps + np.arange(ps, dtype=np.int64)[None, :]).reshape(-1)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V for one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def capacity_from_memory(
    available_bytes: int, mem_fraction: float, bytes_per_token: int, page_size: int
) -> int:
    """Max KV tokens (whole pages) that fit in ``mem_fraction`` of ``available_bytes``."""
    if not 0.0 < mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    tokens = int(available_bytes * mem_fraction) // bytes_per_token
    # One page is the scratch page; keep it inside the budget.
    pages = tokens // page_size - 1
    if pages < 1:
        raise ValueError(
            f"{available_bytes * mem_fraction / 2**20:.1f} MiB holds no KV page "
            f"({bytes_per_token} bytes per token, page_size {page_size})"
        )
    return pages * page_size


def kv_capacity(
    device: torch.device,
    bytes_per_token: int,
    mem_fraction: float,
    page_size: int,
    ranks_sharing_host: int = 1,
) -> int:
    """KV tokens this process can hold, measured after its weights are loaded: ``mem_fraction`` of
    the device's free memory (CUDA), or of a quarter of the host's available RAM split between the
    ``ranks_sharing_host`` processes of a tensor-parallel group (CPU: they share one host's RAM)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return capacity_from_memory(free, mem_fraction, bytes_per_token, page_size)
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(ranks_sharing_host, 1)
    return capacity_from_memory(avail, mem_fraction * 0.25, bytes_per_token, page_size)


def host_kv_tokens(gib: float, bytes_per_token: int, page_size: int) -> int:
    """Tokens (whole pages) of a host KV tier of ``gib`` GiB; 0 when that holds no page."""
    pages = int(gib * 2**30) // (bytes_per_token * page_size) - 1  # one page is the scratch page
    return max(pages, 0) * page_size
