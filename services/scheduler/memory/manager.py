"""KVCacheManager: the one place that gives requests KV slots and takes them back.

It composes the page allocator, the ReqToTokenPool and the prefix cache, and keeps
the accounting invariant checkable at any time:

    free + evictable + protected + private pages of live requests == capacity

and, with a host tier (``host_kv_tokens``), every host page is free or one tree node's:

    host free + host_size == host capacity
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from radixserve.common.service_config import ENGINE_DEFAULTS
from radixserve.scheduler.memory.allocator import OutOfPagesError, PagedAllocator, pages_for
from radixserve.scheduler.memory.disk_cache import DiskTieredCache
from radixserve.scheduler.memory.disk_tier import DiskTier
from radixserve.scheduler.memory.hybrid_cache import HybridRadixCache, SnapshotSlots
from radixserve.scheduler.memory.hybrid_tiered_cache import HybridTieredCache
from radixserve.scheduler.memory.no_cache import NoCache
from radixserve.scheduler.memory.radix_cache import MatchResult, RadixCache, TreeNode
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.memory.state_pool import first_snapshot_slot, zero_slot
from radixserve.scheduler.memory.states import StateTracker
from radixserve.scheduler.memory.tiered_cache import KVTransfers, TieredRadixCache
from radixserve.scheduler.req import Req


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    max_total_tokens: int  # KV capacity in tokens (rounded down to whole pages)
    page_size: int = ENGINE_DEFAULTS.page_size
    max_running_requests: int = ENGINE_DEFAULTS.max_running_requests
    max_context_len: int = 8192  # the engine passes the model's (or its max_context_len argument)
    disable_radix_cache: bool = ENGINE_DEFAULTS.disable_radix_cache
    # Hybrid models: each row also holds a recurrent state; the tree holds up to ``state_snapshots``
    # snapshots of them (memory/hybrid_cache.py), also every ``snapshot_interval`` tokens of a prefill.
    hybrid: bool = False
    state_snapshots: int = 0
    snapshot_interval: int = 0
    # The host KV tier (docs/architecture.md, "KV tiers"): tokens of host memory for KV evicted from the
    # device (0: off), in pages of ``page_size``.
    host_kv_tokens: int = 0
    kv_write_through: bool = False  # copy to the host at insert instead of at eviction
    # Hybrid models with the host tier: host slots for the state snapshots the device pool evicts
    # (memory/hybrid_tiered_cache.py; 0: none, they are dropped).
    host_state_snapshots: int = 0
    # The disk KV tier under the host tier (memory/disk_tier.py; None: off). Needs the host tier.
    disk: DiskTier | None = None


_NONE = np.zeros(0, dtype=np.int64)
DISK_NEEDS_HOST = "kv_disk_cache_dir: the disk KV tier needs the host tier (host_kv_cache_gb > 0)"
HYBRID_DISK_REFUSED = (
    "kv_disk_cache_dir: the disk KV tier does not serve hybrid models (its files hold KV blocks, not the "
    "linear-attention layers' recurrent states); use the host tier (host_kv_cache_gb) alone"
)


class KVCacheManager:
    def __init__(self, config: MemoryConfig) -> None:
        if config.max_total_tokens < config.page_size:
            raise ValueError("max_total_tokens must hold at least one page")
        self.config = config
        self.page_size = config.page_size
        self.allocator = PagedAllocator(config.max_total_tokens // config.page_size, config.page_size)
        rows = config.max_running_requests
        self.req_to_token = ReqToTokenPool(rows, config.max_context_len)
        self.host: PagedAllocator | None = None
        no_host = config.host_kv_tokens < config.page_size or config.disable_radix_cache
        if config.disk is not None and config.hybrid:
            raise ValueError(HYBRID_DISK_REFUSED)
        if config.disk is not None and no_host:
            raise ValueError(DISK_NEEDS_HOST)
        if config.host_kv_tokens >= config.page_size and not config.disable_radix_cache:
            self.host = PagedAllocator(config.host_kv_tokens // config.page_size, config.page_size)
        self.cache: RadixCache
        if config.disable_radix_cache:
            self.cache = NoCache(self.allocator, self.req_to_token)
        elif config.hybrid:
            snapshots = SnapshotSlots(first_snapshot_slot(rows), config.state_snapshots)
            if self.host is None:
                self.cache = HybridRadixCache(self.allocator, self.req_to_token, snapshots)
            else:  # snapshots stay on the device's StatePool when their nodes' KV goes to the host ...
                n = config.host_state_snapshots  # ... and those its LRU evicts go to host slots
                self.cache = HybridTieredCache(
                    self.allocator, self.req_to_token, self.host, snapshots, config.kv_write_through,
                    SnapshotSlots(0, n) if n > 0 else None,
                )  # fmt: skip
        elif self.host is not None and config.disk is not None:
            args = (self.allocator, self.req_to_token, self.host, config.disk, config.kv_write_through)
            self.cache = DiskTieredCache(*args)
        elif self.host is not None:
            write_through = config.kv_write_through
            self.cache = TieredRadixCache(self.allocator, self.req_to_token, self.host, write_through)
        else:
            self.cache = RadixCache(self.allocator, self.req_to_token)
        self.states = (
            StateTracker(self.cache, zero_slot(rows), config.page_size, config.snapshot_interval)
            if config.hybrid
            else None
        )
        # Prefix tokens admitted requests got from each tier instead of computing them (every
        # admission: a retracted request's readmission counts again); metrics read it.
        # Prompt tokens served from each tier, of admissions that stood (a Prometheus counter reads it
        # from another thread: it never goes down); this step's, which an admission undone takes back
        # from, are settled when the step is scheduled (``settle_hits``).
        self.hit_tokens = {"device": 0, **({"host": 0} if self.host is not None else {})}
        self._unsettled_hits = dict.fromkeys(self.hit_tokens, 0)
        self._load_locks: list[TreeNode] = []  # paths locked by ``start_load`` until ``release_loads``
        self._queued_loads: list[tuple[Req, npt.NDArray[np.int64]]] = []  # since ``take_transfers``

    # ---------------------------------------------------------------- sizes
    @property
    def capacity(self) -> int:
        return self.allocator.capacity_tokens

    def available(self) -> int:
        """Tokens that can be handed out now: free pages plus what eviction can free."""
        return self.allocator.free_tokens + self.cache.evictable_size

    def usage(self) -> float:
        """Fraction of the pool neither free nor evictable."""
        return 1.0 - self.available() / self.capacity

    # ------------------------------------------------------------ matching
    def match(self, req: Req) -> MatchResult:
        """Find ``req``'s cached prefix, leaving at least one token to compute.

        Records the length on ``req.match_len`` (the policy sorts by it) and keeps the
        result for ``cached_match`` until the cache changes.
        """
        m = self.cache.match_prefix(_match_ids(req))
        req.match_len = m.length
        req.last_match = (self.cache.version, m)
        return m

    def cached_match(self, req: Req) -> MatchResult:
        """``req``'s earlier match if the cache has not changed since (no insert, no eviction).

        Splits do not count: a match's path and slots survive them.
        """
        if req.last_match is not None and req.last_match[0] == self.cache.version:
            return req.last_match[1]
        return self.match(req)

    def want_hits_of(self, waiting: Iterable[Req]) -> None:
        """Mark the cached prefixes that ``waiting`` requests matched since the cache last changed
        (the policy's matches this step) as wanted: evicted last, and kept out of the room that
        ``available_keeping_wanted`` offers new work."""
        version = self.cache.version
        self.cache.want(  # a match's host part too: host eviction keeps it last
            r.last_match[1].host_node or r.last_match[1].node
            for r in waiting
            if r.last_match is not None and r.last_match[0] == version and r.match_len > 0
        )

    def available_keeping_wanted(self) -> int:
        """``available()`` less the evictable tokens that waiting requests will hit."""
        return self.available() - self.cache.wanted_evictable_size()

    def admit(self, req: Req, m: MatchResult) -> None:
        """Give ``req`` a table row and lock its matched prefix; a host part of the match gets device
        pages and its load is queued (``req.cached_len`` says how much of ``m`` it got)."""
        assert req.req_pool_idx is None
        row = self.req_to_token.alloc()
        req.req_pool_idx = row
        self.cache.lock(m.node)
        if self.cache.needs_load(m):  # the host part back to the device, before this step's forward
            m = self._load(req, m)
        # Its device part may hold pages loaded for it since it last ran (it waited a step for them,
        # or an admission undone for want of room queued them): those are the host's hits.
        loaded = m.slots[np.isin(m.slots, req.loaded_slots)] if len(req.loaded_slots) else _NONE
        req.loaded_len, req.loaded_slots = len(loaded), loaded
        self._unsettled_hits["device"] += len(m.slots) - len(loaded)
        if len(loaded):
            self._unsettled_hits["host"] += len(loaded)
        if len(m.slots):
            self.req_to_token.write(row, 0, m.slots)
        req.last_node = m.node
        req.last_match = None
        req.cached_len = req.kv_len = req.alloc_len = len(m.slots)
        if self.states is not None:
            self.states.admitted(req, m)

    def _load(self, req: Req, m: MatchResult) -> MatchResult:
        """Queue the load of ``m``'s host part for ``req`` (``m.node`` locked: the lock moves to the
        device match returned, which lacks the host part when the device cannot hold it)."""
        loaded = self.cache.load_back(m)
        self.cache.lock(loaded.node)
        self.cache.unlock(m.node)
        new = loaded.slots[len(m.slots) :]
        if len(new):
            req.loaded_slots = np.concatenate([req.loaded_slots, new])
            self._queued_loads.append((req, new))
        return loaded

    def start_load(self, req: Req, m: MatchResult) -> bool:
        """Give ``m``'s host part device pages and queue its load for ``req``, which waits for it
        (it joins a later step's batch: this step's runs beside the copies). Its path stays locked
        until ``release_loads`` (the end of this step's admissions: they must not evict it). False:
        the device cannot hold it."""
        self.cache.lock(m.node)
        loaded = self._load(req, m)
        req.last_match = None
        if len(loaded.slots) <= len(m.slots):  # (shorter: a hybrid's resumable part of the device part)
            self.cache.unlock(loaded.node)
            return False
        self._load_locks.append(loaded.node)
        return True

    def release_loads(self) -> None:
        """Unlock the paths ``start_load`` locked: evictable again (a decode that needs the room may
        take them: their requests load them again), and wanted while their requests wait."""
        for node in self._load_locks:
            self.cache.unlock(node)
        self._load_locks = []

    def reads_loading(self, node: TreeNode | None) -> bool:
        """Whether the path to ``node`` holds pages a queued load writes (a request admitted on it
        reads them: it waits for the copies, or its step's forward must)."""
        return self.cache.path_loading(node)

    def settle_hits(self) -> None:
        """This step's admissions stand (its batch is scheduled): their hits count."""
        for tier, n in self._unsettled_hits.items():
            self.hit_tokens[tier] += n
            self._unsettled_hits[tier] = 0

    def unadmit(self, req: Req) -> None:
        """Undo ``admit`` for a request that got no pages after all."""
        assert req.req_pool_idx is not None and req.last_node is not None and req.alloc_len == req.cached_len
        self._unsettled_hits["device"] -= req.cached_len - req.loaded_len  # its next admission counts them
        if req.loaded_len:
            self._unsettled_hits["host"] -= req.loaded_len
        req.loaded_len = 0  # its queued loads run all the same: ``loaded_slots`` keeps them
        self.cache.unlock(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx = req.last_node = None
        req.cached_len = req.kv_len = req.alloc_len = 0
        req.state_src = -1

    # ---------------------------------------------------------- allocation
    def _ensure_free_pages(self, n: int) -> None:
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.cache.evict(short * self.page_size)
            if self.allocator.num_free_pages < n:
                raise OutOfPagesError(f"need {n} pages, {self.allocator.num_free_pages} free after eviction")

    def pages_to_extend(self, req: Req, n: int) -> int:
        return pages_for(req.alloc_len + n, self.page_size) - pages_for(req.alloc_len, self.page_size)

    def alloc_extend(self, req: Req, n: int) -> npt.NDArray[np.int64]:
        """Slots for tokens ``[alloc_len, alloc_len + n)`` of ``req``; evicts if needed."""
        ps, a, row = self.page_size, req.alloc_len, req.req_pool_idx
        assert row is not None
        if a + n > self.req_to_token.max_context:
            raise ValueError(
                f"request {req.rid} needs {a + n} tokens, max context is {self.req_to_token.max_context}"
            )
        self._ensure_free_pages(self.pages_to_extend(req, n))
        in_last = min(n, (-a) % ps)  # room left on the request's last, partial page
        parts: list[npt.NDArray[np.int64]] = []
        if in_last:
            last = int(self.req_to_token.host[row, a - 1])
            parts.append(np.arange(last + 1, last + 1 + in_last, dtype=np.int64))
        rest = n - in_last
        if rest:
            pages = self.allocator.alloc_pages(pages_for(rest, ps))
            parts.append(self.allocator.pages_to_slots(pages)[:rest])
        slots = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.req_to_token.write(row, a, slots)
        req.alloc_len = a + n
        return slots

    def decode_pages_needed(self, reqs: Sequence[Req]) -> int:
        ps = self.page_size
        return sum(1 for r in reqs if r.alloc_len % ps == 0)

    def alloc_decode(self, reqs: Sequence[Req]) -> npt.NDArray[np.int64]:
        """One slot per request for its next token, in one vectorised step."""
        ps = self.page_size
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        cols = np.fromiter((r.alloc_len for r in reqs), dtype=np.int64, count=len(reqs))
        if cols.max(initial=0) >= self.req_to_token.max_context:
            raise ValueError("a running request reached max_context_len")
        if ps == 1:
            self._ensure_free_pages(len(reqs))
            slots = self.allocator.alloc_pages(len(reqs))
        else:
            new_page = cols % ps == 0
            self._ensure_free_pages(int(new_page.sum()))
            slots = np.empty(len(reqs), dtype=np.int64)
            slots[new_page] = self.allocator.alloc_pages(int(new_page.sum())) * ps
            cont = ~new_page
            slots[cont] = self.req_to_token.host[rows[cont], cols[cont] - 1] + 1
        self.req_to_token.write_tokens(rows, cols, slots)
        for r in reqs:
            r.alloc_len += 1
        return slots

    def read_disk(self, req: Req, m: MatchResult) -> bool:
        """Whether ``req`` waits for the part of its prefix past its match ``m`` that is on disk
        (its read started now, or in flight)."""
        return self.cache.read_disk(_match_ids(req), m)

    def poll(self) -> None:
        """Take what the disk tier's reader finished into the cache (each step, before matching)."""
        self.cache.poll()

    def await_disk_read(self, timeout_s: float) -> None:
        """Sleep until a disk read in flight lands (at most ``timeout_s``; at once when none is): for
        a step that found nothing to run, so an engine whose waiting requests all wait on reads
        does not spin."""
        self.cache.await_disk_read(timeout_s)

    def take_transfers(self, readers: Sequence[Req] = ()) -> tuple[KVTransfers | None, list[tuple[Req, int]]]:
        """The host-tier copies the next step runs (None: none), with ``load_sync`` when one of
        ``readers`` (its batch) reads pages they load; and the requests the loads are for, with
        their tokens (a load dropped since with its pages is not counted)."""
        sync = any(self.reads_loading(r.last_node) for r in readers)
        queued, self._queued_loads = self._queued_loads, []
        t = self.cache.take_transfers()
        if t is None:
            return None, []
        owners = [(r, n) for r, slots in queued if (n := int(np.isin(slots, t.load_dst).sum()))]
        return (t._replace(load_sync=np.ones(1, dtype=np.int64)) if sync else t), owners

    # ------------------------------------------------------------- release
    def cache_written(self, req: Req, upto: int) -> None:
        """After a forward wrote ``req``'s first ``upto`` tokens: hand them to the cache, keep them locked."""
        self.cache.cache_unfinished_req(req, upto)

    def release(self, req: Req) -> None:
        """The request ends (finished, aborted or retracted): cache what it wrote, free the rest."""
        req.loaded_slots = _NONE  # a readmission's hits are the device's
        if req.req_pool_idx is not None:
            self.cache.cache_finished_req(req)

    # --------------------------------------------------------------- checks
    def private_pages(self, req: Req) -> int:
        if req.req_pool_idx is None:
            return 0
        return pages_for(req.alloc_len, self.page_size) - req.cached_len // self.page_size

    def check(self, live: Iterable[Req]) -> None:
        """Assert every accounting and ownership invariant; raises AssertionError."""
        live = list(live)
        ps, alloc, cache = self.page_size, self.allocator, self.cache
        assert not self._load_locks, "a path locked for a load outlived its step's admissions"
        owner = np.zeros(alloc.num_pages + 1, dtype=np.int32)  # how many owners each page has

        nodes = [] if cache.disabled else cache.nodes()
        evictable = protected = 0
        for node in nodes:
            assert len(node) % ps == 0 and len(node) > 0, f"unaligned node {node!r}"
            assert node.lock_ref >= 0
            assert node.parent is not None
            assert node.on_device or node.on_host, f"{node!r} is on no tier"
            for tier in (node.value, node.host_value):
                assert len(tier) in (0, len(node)), f"{node!r} holds part of its KV"
            if node.on_device:  # device residency is closed under parents
                assert node.parent is cache.root or node.parent.on_device, f"{node!r} under a host-only node"
            else:
                assert node.lock_ref == 0, f"host-only {node!r} is locked"
            if node.lock_ref:
                protected += len(node)
                assert node.parent is cache.root or node.parent.lock_ref >= node.lock_ref
            elif node.on_device:
                evictable += len(node)
            np.add.at(owner, node.value[::ps] // ps, 1)
        assert evictable == cache.evictable_size, (evictable, cache.evictable_size)
        assert protected == cache.protected_size, (protected, cache.protected_size)
        self._check_host(nodes)

        private = 0
        rows = set()
        for r in live:
            if r.req_pool_idx is None:
                continue
            assert r.req_pool_idx not in rows, "two requests share a table row"
            rows.add(r.req_pool_idx)
            assert r.cached_len % ps == 0 and r.cached_len <= r.kv_len <= r.alloc_len
            assert r.last_node is not None and (r.last_node is cache.root or r.last_node.lock_ref > 0)
            row = self.req_to_token.host[r.req_pool_idx]
            if not cache.disabled:
                # The row's cached part must be exactly the tree's slots along its path.
                m = cache.match_kv(r.fill_ids()[: r.cached_len])
                assert len(m.slots) == r.cached_len and np.array_equal(m.slots, row[: r.cached_len])
            tail = row[r.cached_len : r.alloc_len].astype(np.int64)
            if len(tail):
                pages = tail[::ps] // ps
                # Within a page, slots are consecutive.
                expect = self.allocator.pages_to_slots(pages)[: len(tail)]
                assert np.array_equal(expect, tail), "private slots do not follow their pages"
                np.add.at(owner, pages, 1)
            private += self.private_pages(r)
        assert self.req_to_token.num_free + len(rows) == self.req_to_token.max_running, "leaked table row"

        free_pages = alloc._stack[: alloc._top]
        np.add.at(owner, free_pages, 1)
        assert owner[0] == 0, "scratch page handed out"
        assert (owner[1:] == 1).all(), (
            f"pages with no owner: {np.flatnonzero(owner[1:] == 0)[:8] + 1}, "
            f"with several: {np.flatnonzero(owner[1:] > 1)[:8] + 1}"
        )
        total = alloc.free_tokens + cache.evictable_size + cache.protected_size + private * ps
        assert total == self.capacity, (total, self.capacity)
        if self.states is not None:
            self.states.check()

    def _check_host(self, nodes: list[TreeNode]) -> None:
        """Every host page is free or one node's; a node a queued load reads keeps its host copy."""
        host, cache = self.host, self.cache
        if host is None:
            assert not any(n.on_host for n in nodes), "host KV without a host tier"
            return
        assert isinstance(cache, TieredRadixCache)
        ps = self.page_size
        owner = np.zeros(host.num_pages + 1, dtype=np.int32)
        size = 0
        for node in nodes:
            if node.on_host:
                size += len(node)
                pages = node.host_value[::ps] // ps
                expect = host.pages_to_slots(pages)
                assert np.array_equal(expect, node.host_value), "host slots do not follow their pages"
                np.add.at(owner, pages, 1)
        for node in cache.loading:
            assert node.on_device and node.on_host, f"a queued load of {node!r} has lost a tier"

        # Queued copies touch only pages of the nodes they were queued for: never a free page, nor
        # one handed to someone else since (two copies into one page would race).
        def owned(queued: list[npt.NDArray[np.int64]], tier: list[npt.NDArray[np.int64]]) -> bool:
            if not queued:
                return True
            slots = np.concatenate(queued)
            return len(np.unique(slots)) == len(slots) and bool(np.isin(slots, np.concatenate(tier)).all())

        stores, loads = cache.queued_copies()
        assert owned([d for _, d in stores], [n.host_value for n in cache.storing] + [_NONE])
        assert owned([s for s, _ in loads], [n.host_value for n in cache.loading] + [_NONE])
        assert owned([d for _, d in loads], [n.value for n in cache.loading] + [_NONE])
        assert size == cache.host_size, (size, cache.host_size)
        np.add.at(owner, host._stack[: host._top], 1)
        assert owner[0] == 0 and (owner[1:] == 1).all(), (
            f"host pages with no owner: {np.flatnonzero(owner[1:] == 0)[:8] + 1}, "
            f"with several: {np.flatnonzero(owner[1:] > 1)[:8] + 1}"
        )
        assert host.free_tokens + cache.host_size == host.capacity_tokens
        if isinstance(cache, DiskTieredCache):
            cache.check_disk()


def _match_ids(req: Req) -> npt.NDArray[np.int32]:
    """The tokens ``req``'s cached prefix is matched on: all but the last, which is computed for its
    logits. A request scoring its prompt needs the logits of every prompt position: it recomputes
    the prompt rather than reuse cached KV, whose logits were never kept."""
    ids = req.fill_ids()
    return ids[: 0 if req.scores_prompt else len(ids) - 1]
