"""A radix cache over a small page pool, and inserting into it the way a request would."""

from __future__ import annotations

import numpy as np

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.hybrid_cache import HybridRadixCache, SnapshotSlots
from radixserve.scheduler.memory.radix_cache import RadixCache
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool


def make_cache(num_pages=64, page_size=1, cls=RadixCache):
    alloc = PagedAllocator(num_pages, page_size)
    return cls(alloc, ReqToTokenPool(4, 256))


def make_hybrid_cache(num_pages=64, page_size=1, snapshots=4) -> HybridRadixCache:
    """A hybrid model's cache whose snapshot slots are 100 .. 100 + snapshots - 1."""
    return HybridRadixCache(
        PagedAllocator(num_pages, page_size), ReqToTokenPool(4, 256), SnapshotSlots(100, snapshots)
    )


def put(cache: RadixCache, tokens):
    """Allocate pages for tokens (page aligned) and insert them; returns the insert result."""
    tokens = np.asarray(tokens, dtype=np.int32)
    ps = cache.page_size
    slots = cache.allocator.pages_to_slots(cache.allocator.alloc_pages(len(tokens) // ps))
    res = cache.insert(tokens, slots)
    # Whatever was already present is a duplicate: free it like a request would.
    cache.allocator.free_slots(slots[: res.present_len])
    return res


def snapshot_blocks(cache) -> dict[int, str]:
    """The cache's snapshot (``block_snapshot``) as block -> the event that stores it at its tier."""
    return {h: kind for kind, hashes in cache.block_snapshot() for h in hashes}
