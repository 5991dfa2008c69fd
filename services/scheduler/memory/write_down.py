"""Writing the KV tiers down to disk at a graceful stop (docs/architecture.md, "KV tiers").

The disk tier gets only what the host tier drops while serving; a scheduler stopped for a rolling
upgrade or a scale-down would take the rest (its hottest prefixes) with it. At a graceful stop,
after the drain (nothing locked), the device tier is evicted into the host tier and the host tier
into the disk tier, a chunk at a time: each chunk's copies run (the runner's host pool: captures,
write-backs, as in a step) and the writer finishes before the next (the writer drops captures
beyond its backlog), until both are empty or ``deadline_s`` is spent, least recently used first.
With tensor parallelism every rank runs each chunk's copies (``to_ranks``: the followers get them
before rank 0 runs its own; each follower writes its parts and finishes them before its next chunk,
and before it exits at the stop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from radixserve.scheduler.memory.disk_cache import DiskTieredCache
from radixserve.scheduler.memory.host_pool import HostKVPool
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.manager import KVCacheManager
from radixserve.scheduler.memory.tiered_cache import KVTransfers

ToRanks = Callable[[KVTransfers], None] | None  # tensor parallelism: the followers' copies

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20  # per round: well inside the writer's backlog bound (memory/disk_tier.py)


def write_down(
    kv: KVCacheManager,
    host_pool: HostKVPool,
    kv_pool: KVPool,
    bytes_per_token: int,
    deadline_s: float,
    to_ranks: ToRanks = None,
) -> int:
    """Move what the device and host tiers hold to the disk tier, within ``deadline_s``; returns the
    tokens written to disk. Call after the drain (a locked node stays). A failure (a stop after a
    device error) is logged: what is on disk already stays served."""
    cache = kv.cache
    if not isinstance(cache, DiskTieredCache) or cache.disk.off or deadline_s <= 0:
        return 0
    try:
        chunk = max(kv.page_size, CHUNK_BYTES // bytes_per_token)
        return _write_down(kv, cache, host_pool, kv_pool, chunk, deadline_s, to_ranks)
    except Exception:
        log.exception("writing the KV tiers down to disk at the stop failed")
        return 0


def _write_down(
    kv: KVCacheManager,
    cache: DiskTieredCache,
    host_pool: HostKVPool,
    kv_pool: KVPool,
    chunk: int,
    deadline_s: float,
    to_ranks: ToRanks,
) -> int:
    start, written0 = time.monotonic(), cache.disk.written_tokens

    def run_copies() -> None:
        t, _ = kv.take_transfers()
        if t is not None:
            if to_ranks is not None:
                to_ranks(t)
            host_pool.run(kv_pool, t)
        cache.disk.flush()

    def in_time() -> bool:
        return time.monotonic() - start < deadline_s and not cache.disk.off

    # Into the host tier (write-backs; a full host tier drops its oldest to disk: captures), then
    # the host-only nodes to disk (captures; on CUDA the last write-backs land first, in the run).
    while cache.evictable_size and in_time() and cache.evict(chunk):
        run_copies()
    while cache.host_size and in_time() and cache.evict_host(chunk):
        run_copies()
    written = cache.disk.written_tokens - written0
    left = cache.evictable_size + cache.host_size
    log.info(
        "KV written down to disk at the stop: %d tokens in %.2f s%s",
        written, time.monotonic() - start, f" ({left} tokens left: out of time, or held)" if left else "",
    )  # fmt: skip
    return written
