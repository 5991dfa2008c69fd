"""HybridRadixCache: the radix prefix cache for hybrid models, whose linear-attention layers carry
a recurrent state instead of KV.

A recurrent state cannot be cut at an arbitrary prefix the way paged KV can: to resume a prompt
after its first ``p`` tokens, a request needs the state after exactly those tokens. So tree nodes
hold state snapshots (a slot of the StatePool, memory/state_pool.py) taken at their end, and a
prefix can be resumed only up to the deepest node on its path that has one:

    tokens:  0 ........ 256 ............. 600 ............ 900
    KV:      [node A     ][node B          ][node C          ]   pages, as for a dense model
    state:              *A                               *C     snapshots at node ends
    a prompt sharing 0..700 resumes at 256 (A's), recomputes 256..; one sharing 0..950 resumes at 900

* A snapshot is only valid with all the KV up to it, which holds by construction: KV is evicted
  leaf first, and evicting a node drops its snapshot; a node keeps its KV when its snapshot goes.
* Snapshots live in a bounded pool (``SnapshotSlots``). A new one takes a free slot, else the
  least recently used snapshot of a node nobody locks (a request that matched a node locks it, so
  the snapshot it will copy stays until it has); when every snapshot is locked, none is taken.
* KV eviction takes leaves without a snapshot first: their KV cannot be resumed from.
* ``match_prefix`` returns the longest resumable prefix (and ``branch``, where the prompt leaves
  the tree's KV: the scheduler snapshots there, so the next request that leaves at the same point
  resumes from it); ``match_kv`` the plain KV match.
* When a request ends (finish, abort, retraction) with its state exactly at a page boundary, the
  tree takes a snapshot there: a copy from the request's row queued for the next step
  (``take_copies``), before anything can reuse the row.
* Block events (the cluster's prefix index) report only blocks that lie at or before a snapshot on
  their path: a node's blocks are reported while its subtree holds a snapshot (``snaps_below``). A
  prompt that runs through a snapshot resumes from it; one that leaves the path between two
  snapshots resumes from the earlier one, so a pod over-reports by at most their distance.
* With the host KV tier (memory/hybrid_tiered_cache.py) a node keeps its snapshot while its KV is on
  the host, and ``match_prefix`` may end at a snapshot in the match's host part; a snapshot the pool's
  LRU takes may be written back to a host snapshot slot (``host_snapshot``): a node with a snapshot on
  either tier is resumable (``has_snapshot``), and ``snaps_below`` counts such nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.radix_cache import _EMPTY_SLOTS, MatchResult, RadixCache, TreeNode, _parent
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.req import Req


def has_snapshot(node: TreeNode) -> bool:
    """Whether a request can resume at ``node``'s end: its snapshot is on the device or the host."""
    return node.snapshot >= 0 or node.host_snapshot >= 0


def on_device(node: TreeNode) -> bool:
    """Whether ``node``'s snapshot is on the device (a match there resumes with no load)."""
    return node.snapshot >= 0


class SnapshotSlots:
    """The snapshot slots ``first .. first + capacity - 1`` of the StatePool: who may write which."""

    def __init__(self, first: int, capacity: int) -> None:
        self.first, self.capacity = first, capacity
        self._free = list(range(first + capacity - 1, first - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if not self.first <= slot < self.first + self.capacity or slot in self._free:
            raise ValueError(f"double free of state snapshot {slot}")
        self._free.append(slot)

    def free_slots(self) -> list[int]:
        return list(self._free)


class HybridRadixCache(RadixCache):
    def __init__(
        self, allocator: PagedAllocator, req_to_token: ReqToTokenPool, snapshots: SnapshotSlots
    ) -> None:
        self._init_snapshots(snapshots)
        super().__init__(allocator, req_to_token)

    def _init_snapshots(self, snapshots: SnapshotSlots) -> None:
        """This class's own state (memory/hybrid_tiered_cache.py sets it up before the tiered base's)."""
        self.snapshots = snapshots
        self.held: dict[int, TreeNode] = {}  # snapshot slot -> the node it belongs to
        self.copies: dict[int, int] = {}  # snapshot slot -> the row whose state it takes before the next step

    def reset(self) -> None:
        for slot in self.held:
            self.snapshots.free(slot)
        self.held, self.copies = {}, {}
        super().reset()

    # ------------------------------------------------------------------ match
    def match_prefix(self, tokens: npt.NDArray[np.integer]) -> MatchResult:
        """The longest prefix of ``tokens`` a request can resume from: KV (on any tier) and a snapshot
        at its end."""
        kv = super().match_prefix(tokens)
        return self._resumable(kv, kv.length)

    def _resumable(
        self, kv: MatchResult, branch: int, resumable: Callable[[TreeNode], bool] = has_snapshot
    ) -> MatchResult:
        """The KV match ``kv`` cut at the deepest node on its path that is ``resumable`` (by default:
        has a snapshot on either tier), which may lie in its host part (memory/hybrid_tiered_cache.py):
        then that part up to the snapshot is ``host_node``/``host_len``."""
        node = kv.host_node or kv.node
        while node is not self.root and not resumable(node):
            node = _parent(node)
        end = 0 if node is self.root else node.depth + len(node)
        if end > len(kv.slots):
            return MatchResult(kv.slots, kv.node, branch, node, end - len(kv.slots))
        return MatchResult(kv.slots[:end] if end else _EMPTY_SLOTS, node, branch)

    def match_kv(self, tokens: npt.NDArray[np.integer]) -> MatchResult:
        return super().match_prefix(tokens)

    # -------------------------------------------------------------- snapshots
    def alloc_snapshot(self) -> int | None:
        """A snapshot slot: a free one, else the least recently used unlocked one (evicted); None
        when every snapshot is locked (the caller takes none)."""
        slot = self.snapshots.alloc()
        if slot is not None:
            return slot
        unlocked = [n for n in self.held.values() if n.lock_ref == 0]
        if not unlocked:
            return None
        victim = min(unlocked, key=lambda n: (n in self.wanted, n.last_access, n.id))
        self._snapshot_leaving_device(victim)
        self.drop_snapshot(victim)
        return self.snapshots.alloc()

    def _snapshot_leaving_device(self, node: TreeNode) -> None:
        """The pool's LRU is about to take ``node``'s snapshot (the host tier writes it back)."""

    def attach(self, tokens: npt.NDArray[np.integer], slot: int) -> bool:
        """Give the node ending after ``tokens`` (page aligned, cached) the snapshot in ``slot``;
        False (and ``slot`` freed) when that prefix is not cached or already has one."""
        node, pos, _ = self._walk(np.asarray(tokens, dtype=np.int32))
        if pos != len(tokens) or node is self.root or node.snapshot >= 0:
            self.snapshots.free(slot)
            return False
        self._hold(node, slot)
        return True

    def _hold(self, node: TreeNode, slot: int) -> None:
        if not has_snapshot(node):  # (one on the host only: the node is resumable already)
            self._count(node, +1)
        node.snapshot = slot
        self.held[slot] = node
        self.version += 1  # longer matches than before

    def drop_snapshot(self, node: TreeNode) -> None:
        slot = node.snapshot
        node.snapshot = -1
        del self.held[slot]
        self.copies.pop(slot, None)  # a copy not run yet: its slot is about to be someone else's
        if not has_snapshot(node):  # (one on the host too: still resumable)
            self._count(node, -1)
        self.snapshots.free(slot)
        self.version += 1  # shorter matches than before

    def _count(self, node: TreeNode | None, delta: int) -> None:
        """Add ``delta`` to the snapshot counts from ``node`` up; a node whose subtree gains its first
        snapshot reports its blocks, one that loses its last withdraws them."""
        while node is not None and node is not self.root:
            before = node.snaps_below
            node.snaps_below += delta
            if self.record_events and node.blocks and (before == 0) != (node.snaps_below == 0):
                self.block_events.append((self._tier_event(node) if before == 0 else "removed", node.blocks))
            node = node.parent

    def take_state_transfers(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Copies between device and host snapshot slots for the next step (stores, loads): none
        without a host tier (memory/hybrid_tiered_cache.py)."""
        return _EMPTY_SLOTS, _EMPTY_SLOTS

    def check_host_snapshots(self) -> None:
        """The host snapshot slots' accounting (none without a host tier)."""

    def take_copies(self) -> npt.NDArray[np.int64]:
        """The state copies to run before the next step, ``[sources..., destinations...]``."""
        if not self.copies:
            return _EMPTY_SLOTS
        dst = np.fromiter(self.copies, dtype=np.int64, count=len(self.copies))
        src = np.fromiter(self.copies.values(), dtype=np.int64, count=len(self.copies))
        self.copies = {}
        return np.concatenate([src, dst])

    # ------------------------------------------------------- the base's hooks
    def _blocks_event(self, kind: str, node: TreeNode) -> None:
        if node.snaps_below > 0:  # only blocks at or before a snapshot can be resumed
            super()._blocks_event(kind, node)

    def _evict_last(self, leaf: TreeNode) -> bool:
        return has_snapshot(leaf)

    def _evicting(self, leaf: TreeNode) -> None:
        if leaf.snapshot >= 0:  # it leaves the tree: a snapshot never outlives the KV before it
            self.drop_snapshot(leaf)
        super()._evicting(leaf)

    def all_block_hashes(self) -> list[int]:
        return [h for node in self.nodes() if node.snaps_below > 0 for h in node.blocks]

    def block_snapshot(self) -> list[tuple[str, list[int]]]:
        """The base's, by tier, less the blocks no snapshot lies at or after."""
        keep = set(self.all_block_hashes())
        by_tier = [(kind, [h for h in hashes if h in keep]) for kind, hashes in super().block_snapshot()]
        return [(kind, hashes) for kind, hashes in by_tier if hashes]

    def cache_finished_req(self, req: Req) -> None:
        """As the base's, plus a snapshot of the request's state where its cached KV ends, when
        that is exactly where its state is (every token it holds KV for, on a page boundary)."""
        self._take_written(req)
        node = req.last_node
        assert node is not None and req.req_pool_idx is not None
        if 0 < req.cached_len == req.kv_len and node.snapshot < 0:
            slot = self.alloc_snapshot()  # never this node's: the request locks it
            if slot is not None:
                self.copies[slot] = req.req_pool_idx
                self._hold(node, slot)
        self._free_private(req)
        self.unlock(node)
        self._drop_row(req)
