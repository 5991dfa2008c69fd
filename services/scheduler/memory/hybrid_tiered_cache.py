"""HybridTieredCache: a hybrid model's prefix cache (memory/hybrid_cache.py) with the host KV tier under
it (memory/tiered_cache.py), and host snapshot slots under the device's; docs/architecture.md, "KV
tiers" and "State snapshots (hybrid models)".

A node keeps its state snapshot when its KV goes to the host: the snapshot is a slot of the device's
StatePool, so it needs no copy to or from the host. A snapshot never outlives the KV before it, on
any tier: it goes with its node when the node leaves the tree (device eviction with no host copy,
host eviction of a host-only leaf). So a host-only node with a snapshot stays resumable:
``match_prefix`` reports the prefix up to the deepest snapshot on the path, its device part in
``slots``/``node`` and its host part in ``host_node`` (the snapshot's node)/``host_len``;
``load_back`` brings the host part to the device and returns the match ending at that node, whose
snapshot the request's state starts from (and which the request locks from its admission until it
ends, so the snapshot stays until its copy has run).

Host snapshots (``host_snapshots``; None: none, as without the tier). The device snapshot pool is
small (a tenth of the device memory), and between two turns of a conversation the others' snapshots
take every slot. So a snapshot the device pool's LRU takes (``alloc_snapshot``) is written back to a
host snapshot slot (a copy queued for the next step, ``take_state_transfers``) unless its node has
one already (a snapshot of a prefix never changes: the host copy stays valid). A node with a
snapshot on either tier is resumable. A match that ends at a host-only snapshot gets a device slot
for it in ``load_back`` (a host -> device copy queued) before the request's ``inits`` copy reads it;
when every device snapshot is locked, ``load_back`` returns the match cut at the deepest snapshot on
the device (the callers then do not run the request at it: it waits, or is matched again), as when
the device cannot hold the host KV part. Host snapshot slots go LRU (those with a device copy first),
never a locked node's nor one a queued load reads; a node leaving the tree drops both.

The runner runs a step's state copies in this order (model/state_step.py ``run_copies``): stores
(device -> host), loads (host -> device), then ``copies``, ``inits``, and the forward's ``cuts``; so a
device slot a store reads may be a load's, a copy's or a cut's destination in the same step. A
store's source is the evicted snapshot's slot, or, when its ``copies`` entry (a request's row into
it) has not run yet, that row (valid until the step runs): the copy entry goes. A store into a host
slot dropped before the step goes with it; a load into a device slot dropped goes with it.

Both tiers' evictions take nodes without a snapshot first. A device leaf with no snapshot at or
below it is not written back: no request could resume from its KV (a match stops at the deepest
snapshot), so on the host it would only take room. Block events are the hybrid's (blocks reported
while their subtree holds a snapshot, on either tier) at the tier's event (``stored``, ``stored_host``).

The disk tier does not serve hybrid models: its files hold KV blocks, not recurrent states.

Composition: the two classes share RadixCache's hooks and each calls ``super()`` in them, so with
HybridRadixCache first in the order every hook runs both (the snapshot dropped, then the host pages
freed, when a node leaves the tree).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.hybrid_cache import HybridRadixCache, SnapshotSlots, has_snapshot, on_device
from radixserve.scheduler.memory.radix_cache import _EMPTY_SLOTS, MatchResult, TreeNode
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
        host_snapshots: SnapshotSlots | None = None,
    ) -> None:
        """``host_snapshots``: the host snapshot slots (HostStatePool's, from 0; None: none)."""
        self.host_snapshots = host_snapshots
        self.stored_snapshots = self.loaded_snapshots = 0  # copies to and from the host, all time
        # HybridRadixCache's state (its __init__ would call the next one's without a host)
        self._init_snapshots(snapshots)
        TieredRadixCache.__init__(self, allocator, req_to_token, host, write_through)

    def reset(self) -> None:
        for slot in getattr(self, "host_held", {}):  # (none yet when the base's __init__ resets)
            assert self.host_snapshots is not None
            self.host_snapshots.free(slot)
        self.host_held: dict[int, TreeNode] = {}  # host snapshot slot -> the node it belongs to
        self.snap_stores: dict[int, int] = {}  # host slot -> the state slot (snapshot or row) it takes
        self.snap_loads: dict[int, int] = {}  # device snapshot slot -> the host slot it takes
        self._loading_snapshot: TreeNode | None = None  # (``load_back``'s, while it gets a device slot)
        super().reset()

    def _leaving_device(self, leaf: TreeNode) -> None:
        if leaf.snaps_below > 0:  # else nothing could resume from its KV on the host
            super()._leaving_device(leaf)

    # ------------------------------------------------------ host snapshots
    def _snapshot_leaving_device(self, node: TreeNode) -> None:
        """Write ``node``'s snapshot back to a host slot, unless it has one (or none can be had)."""
        if node.host_snapshot >= 0 or self.host_snapshots is None:
            return
        slot = self._alloc_host_snapshot()
        if slot is None:
            return
        self.snap_stores[slot] = self.copies.pop(node.snapshot, node.snapshot)  # a row not copied yet
        node.host_snapshot = slot
        self.host_held[slot] = node
        self.stored_snapshots += 1

    def _alloc_host_snapshot(self) -> int | None:
        assert self.host_snapshots is not None
        slot = self.host_snapshots.alloc()
        if slot is not None:
            return slot
        can_go = [
            n
            for n in self.host_held.values()
            if n.lock_ref == 0 and n.snapshot not in self.snap_loads and n is not self._loading_snapshot
        ]
        if not can_go:
            return None
        self.drop_host_snapshot(
            min(can_go, key=lambda n: (n.snapshot < 0, n in self.wanted, n.last_access, n.id))
        )
        return self.host_snapshots.alloc()

    def drop_host_snapshot(self, node: TreeNode) -> None:
        assert self.host_snapshots is not None and node.snapshot not in self.snap_loads
        slot = node.host_snapshot
        node.host_snapshot = -1
        del self.host_held[slot]
        self.snap_stores.pop(slot, None)  # a store not run yet: its slot is about to be someone else's
        if node.snapshot < 0:
            self._count(node, -1)
        self.host_snapshots.free(slot)
        self.version += 1  # shorter matches than before

    def drop_snapshot(self, node: TreeNode) -> None:
        self.snap_loads.pop(node.snapshot, None)  # a load into it not run yet: it goes with the slot
        super().drop_snapshot(node)

    def _evicting(self, leaf: TreeNode) -> None:
        super()._evicting(leaf)  # its device snapshot (and a load into it) first
        if leaf.host_snapshot >= 0:
            self.drop_host_snapshot(leaf)

    def take_state_transfers(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The snapshot copies for the next step to run first: stores (state slots -> host slots) and
        loads (host slots -> device snapshot slots), each ``[sources..., destinations...]``."""
        out = tuple(
            np.array([*queued.values(), *queued], dtype=np.int64) if queued else _EMPTY_SLOTS
            for queued in (self.snap_stores, self.snap_loads)
        )
        self.snap_stores, self.snap_loads = {}, {}
        return out[0], out[1]

    # ------------------------------------------------------------ load back
    def can_resume(self, m: MatchResult) -> bool:
        """False when ``m`` ends at a host-only snapshot and every device snapshot slot is locked: the
        request waits for one (its admission would be undone) while the others go on."""
        end = m.host_node or m.node
        if end is self.root or end.snapshot >= 0 or self.snapshots.num_free:
            return True
        return any(n.lock_ref == 0 for n in self.held.values())

    def needs_load(self, m: MatchResult) -> bool:
        end = m.host_node or m.node
        return m.host_node is not None or (end is not self.root and end.snapshot < 0)

    def load_back(self, m: MatchResult) -> MatchResult:
        """The base's, and the snapshot where ``m`` ends back to a device slot when it is on the host
        only. When the device cannot hold the host KV part, or every device snapshot is locked, the
        device part cut at its deepest snapshot on the device: the callers then do not run the
        request at this shorter match (it waits, or is matched again), but the node returned, which
        they lock and unlock, ends at a snapshot on the device as every admitted match does."""
        end = m.host_node or m.node
        slot = None
        if end is not self.root and end.snapshot < 0:
            self._loading_snapshot = end  # the write-back of the snapshot it evicts must not take end's
            slot = self.alloc_snapshot()  # before the KV's pages: a failure then loads nothing
            self._loading_snapshot = None
            if slot is None:
                return self._on_device(m)
        loaded = super().load_back(m)
        if m.host_node is not None and len(loaded.slots) == len(m.slots):
            if slot is not None:
                self.snapshots.free(slot)
            return self._on_device(loaded)
        if slot is not None:
            self.snap_loads[slot] = end.host_snapshot
            self._hold(end, slot)
            self.loaded_snapshots += 1
        return loaded

    def _on_device(self, m: MatchResult) -> MatchResult:
        """The device part of ``m`` cut at the deepest snapshot on the device on its path."""
        return self._resumable(MatchResult(m.slots, m.node, m.branch), m.branch, on_device)

    # --------------------------------------------------------------- checks
    def check_host_snapshots(self) -> None:
        """Every host snapshot slot is free or one node's; queued stores fill, and queued loads read,
        only host slots their nodes hold (each at most once), loads into device slots held."""
        nodes = self.nodes()
        assert {n.host_snapshot for n in nodes if n.host_snapshot >= 0} == set(self.host_held)
        for n in nodes:
            assert self.host_held.get(n.host_snapshot, n) is n
        if self.host_snapshots is None:
            assert not self.host_held and not self.snap_stores and not self.snap_loads
            return
        free = self.host_snapshots.free_slots()
        assert len(set(free) | set(self.host_held)) == len(free) + len(self.host_held)
        assert len(free) + len(self.host_held) == self.host_snapshots.capacity, "leaked host snapshot"
        assert set(self.snap_stores) <= set(self.host_held), "a store into a host snapshot no node holds"
        for dev, host in self.snap_loads.items():
            assert dev in self.held and self.held[dev].host_snapshot == host, "a load of a dropped snapshot"
        reads = list(self.snap_loads.values())
        assert len(set(reads)) == len(reads)
        assert all(has_snapshot(n) for n in self.host_held.values())
