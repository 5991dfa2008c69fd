"""HybridTieredCache: a hybrid model's prefix cache (memory/hybrid_cache.py) with the host KV tier under
it (memory/tiered_cache.py); docs/architecture.md, "KV tiers" and "State snapshots (hybrid models)".

A node keeps its state snapshot when its KV goes to the host: the snapshot is a slot of the device's
StatePool, so it needs no copy to or from the host. It goes only by the snapshot pool's own LRU
(``alloc_snapshot``) or with its node when the node leaves the tree (device eviction with no host
copy, host eviction of a host-only leaf): a snapshot never outlives the KV before it, on any tier. So
a host-only node with a snapshot stays resumable: ``match_prefix`` reports the prefix up to the
deepest snapshot on the path, its device part in ``slots``/``node`` and its host part in
``host_node`` (the snapshot's node)/``host_len``; ``load_back`` brings the host part to the device
and returns the match ending at that node, whose snapshot the request's state starts from (and which
the request locks from its admission until it ends, so the snapshot stays until its copy has run).

Both tiers' evictions take nodes without a snapshot first. A device leaf with no snapshot at or
below it is not written back: no request could resume from its KV (a match stops at the deepest
snapshot), so on the host it would only take room. Block events are the hybrid's (blocks reported
while their subtree holds a snapshot) at the tier's event (``stored``, ``stored_host``).

The disk tier does not serve hybrid models: its files hold KV blocks, not recurrent states.

Composition: the two classes share RadixCache's hooks and each calls ``super()`` in them, so with
HybridRadixCache first in the order every hook runs both (the snapshot dropped, then the host pages
freed, when a node leaves the tree).
"""

from __future__ import annotations

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.hybrid_cache import HybridRadixCache, SnapshotSlots
from radixserve.scheduler.memory.radix_cache import MatchResult, TreeNode
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.memory.tiered_cache import TieredRadixCache


class HybridTieredCache(HybridRadixCache, TieredRadixCache):
    def __init__(
        self,
        allocator: PagedAllocator,
        req_to_token: ReqToTokenPool,
        host: PagedAllocator,
        snapshots: SnapshotSlots,
        write_through: bool = False,
    ) -> None:
        # HybridRadixCache's state (its __init__ would call the next one's without a host)
        self._init_snapshots(snapshots)
        TieredRadixCache.__init__(self, allocator, req_to_token, host, write_through)

    def _leaving_device(self, leaf: TreeNode) -> None:
        if leaf.snaps_below > 0:  # else nothing could resume from its KV on the host
            super()._leaving_device(leaf)

    def load_back(self, m: MatchResult) -> MatchResult:
        """The base's; when the device cannot hold the host part, the device part cut at its deepest
        snapshot: the callers then do not run the request at this shorter match (it waits, or is
        matched again), but the node returned, which they lock and unlock, ends at a snapshot as
        every match does."""
        loaded = super().load_back(m)
        if m.host_node is not None and len(loaded.slots) == len(m.slots):
            return self._resumable(loaded, m.branch)
        return loaded
