"""TieredRadixCache: the radix cache with a host tier under it (docs/architecture.md, "KV tiers").

A node's KV may be on the device (``value``), on the host (``host_value``), or on both. Device residency is
closed under parents (a node on the device has its whole path on the device), so a path reads
[device nodes][host-only nodes]. Evicting an unlocked device leaf first copies its KV to host pages
(write-back; the copy is queued, ``take_transfers``); the node stays in the tree, host-resident.
``match_prefix`` reports the host part after the device part; ``load_back`` gives it new device
pages and queues the copies back. Queued copies run with the next step, stores before loads (a page
freed by a write-back may be a load's destination in the same step) and before its forward; the
loads' requests wait a step for them (policy/prefill_adder.py) unless nothing else runs. Host pages are
evicted LRU (locked and wanted nodes last); a host page that a queued load reads is never freed.
``evictable_size`` and ``protected_size`` count device tokens only; ``host_size`` counts host ones.
Block events name the best tier of a node's blocks: ``stored_host`` when its device copy goes and
its host copy stays, ``stored`` when it is loaded back, ``removed`` when it leaves every tier.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.memory.allocator import OutOfPagesError, PagedAllocator
from radixserve.scheduler.memory.radix_cache import _EMPTY_SLOTS, MatchResult, RadixCache, TreeNode, _parent
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    import torch


class KVTransfers(NamedTuple):
    """Copies between the device and host KV pools to run with a step, stores first (before its forward;
    the loads too when ``load_sync``)."""

    store_src: npt.NDArray[np.int64]  # device slots written back ...
    store_dst: npt.NDArray[np.int64]  # ... to these host slots
    load_src: npt.NDArray[np.int64]  # host slots loaded back ...
    load_dst: npt.NDArray[np.int64]  # ... into these device slots
    # The disk tier's captures and fills for this step, by sequence number (memory/disk_tier.py;
    # one element, or none). They run first: captures, then fills, then the copies above.
    disk_seq: npt.NDArray[np.int64] = _EMPTY_SLOTS
    # One element when the step's own batch reads pages these loads write: its forward waits for
    # them. Empty: it does not (a request waits a step for its load), the next step's forward does.
    load_sync: npt.NDArray[np.int64] = _EMPTY_SLOTS


_Copies = list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]  # (source slots, destination slots)


# A queued copy: (source slots, destination slots); or the disk tier's fill: (destination slots, KV
# [2L, n, heads, dim]: memory/disk_tier.py).
_Pair = TypeVar(
    "_Pair", tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]], "tuple[npt.NDArray[np.int64], torch.Tensor]"
)


def _without(pairs: list[_Pair], slots: npt.NDArray[np.int64], side: int) -> list[_Pair]:
    """``pairs`` less the tokens whose slot on ``side`` (0 or 1) is in ``slots`` (a fill's KV holds
    its tokens on axis 1)."""
    out: list[_Pair] = []
    for pair in pairs:
        keep = ~np.isin(pair[side], slots)
        if keep.all():
            out.append(pair)
        elif keep.any():
            out.append((pair[0][keep], pair[1][:, keep] if pair[1].ndim > 1 else pair[1][keep]))
    return out


class TieredRadixCache(RadixCache):
    def __init__(
        self,
        allocator: PagedAllocator,
        req_to_token: ReqToTokenPool,
        host: PagedAllocator,
        write_through: bool = False,
    ) -> None:
        """``host``: the host KV pool's pages (the device's page size). ``write_through``: copy new
        nodes to the host when they are inserted, not when they are evicted."""
        if host.page_size != allocator.page_size:
            raise ValueError("the host KV pool's pages must be the device pool's size")
        self.host = host
        self.write_through = write_through
        self.written_back_tokens = 0
        self.loaded_tokens = 0
        super().__init__(allocator, req_to_token)

    def reset(self) -> None:
        super().reset()
        self.host.reset()  # the host pages go back with the nodes (only the tree holds any)
        self.host_size = 0
        self._stores: _Copies = []  # queued write-backs
        self._loads: _Copies = []  # queued load-backs
        self.loading: set[TreeNode] = set()  # nodes whose host pages a queued load reads
        self.storing: set[TreeNode] = set()  # nodes whose host pages a queued write-back fills

    # ------------------------------------------------------- the base's hooks
    def _split(self, child: TreeNode, n: int) -> TreeNode:
        upper = super()._split(child, n)
        for queued in (self.loading, self.storing):
            if child in queued:
                queued.add(upper)
        return upper

    def _inserted(self, leaf: TreeNode) -> None:
        if self.write_through:
            self._write_back(leaf)

    def _leaving_device(self, leaf: TreeNode) -> None:
        if not leaf.on_host:
            self._write_back(leaf)

    def _free_device(self, node: TreeNode) -> None:
        if node in self.loading:  # a load queued into its pages: dropped with them
            self._loads = _without(self._loads, node.value, 1)
            self.loading.discard(node)
        super()._free_device(node)
        if node.on_host:  # else it leaves the tree, "removed"
            self._blocks_event("stored_host", node)

    def _tier_event(self, node: TreeNode) -> str:
        # every node is on some tier: one on neither the device nor the host is on disk
        return "stored" if node.on_device else "stored_host" if node.on_host else "stored_disk"

    def _evicting(self, leaf: TreeNode) -> None:
        assert leaf not in self.loading, "removed a node a queued load reads"
        if leaf.on_host:
            self._free_host(leaf)
        super()._evicting(leaf)

    def _leaving_host(self, leaf: TreeNode) -> None:
        """The host-only ``leaf`` is about to leave the tree (the disk tier writes it down first)."""

    # -------------------------------------------------------------- the tier
    def _free_host(self, node: TreeNode) -> None:
        assert node not in self.loading
        if node in self.storing:  # a queued write-back into its pages: dropped with them
            self._stores = _without(self._stores, node.host_value, 1)
            self.storing.discard(node)
        self.host.free_slots(node.host_value)
        node.host_value = _EMPTY_SLOTS
        self.host_size -= len(node)

    def _write_back(self, node: TreeNode) -> None:
        """Queue a copy of ``node``'s device KV to new host pages (none when the host is full of
        pages that cannot go)."""
        pages = len(node) // self.page_size
        short = pages - self.host.num_free_pages
        if short > 0:
            # At least 1/64 of the tier at a time: each host eviction scans the tree, and an eviction
            # of many device leaves would scan it once per leaf (500 leaves of a 3,500-node tree:
            # 2.3 s, docs/architecture.md).
            batch = max(short, self.host.num_pages // 64) * self.page_size
            self.evict_host(batch, keep=node)
            if self.host.num_free_pages < pages:
                return
        host = self.host.pages_to_slots(self.host.alloc_pages(pages))
        self._stores.append((node.value, host))
        self.storing.add(node)
        self.written_back_tokens += len(node)
        node.host_value = host
        self.host_size += len(node)

    def evict_host(self, num_tokens: int, keep: TreeNode | None = None) -> int:
        """Free at least ``num_tokens`` host tokens: drop the host copy of nodes also on the device,
        remove host-only leaves; unlocked and unwanted first, then (hybrids) those without a state
        snapshot, each least recently used first. Never ``keep``'s path, nor a page a queued load
        reads. Returns the tokens freed."""
        if num_tokens <= 0:
            return 0
        keep_path: set[TreeNode] = set()
        while keep is not None and keep is not self.root:
            keep_path.add(keep)
            keep = keep.parent

        def can_go(n: TreeNode) -> bool:
            free_to_go = n not in keep_path and n not in self.loading
            return n.on_host and free_to_go and (n.on_device or not n.children)

        def entry(n: TreeNode) -> tuple[bool, bool, bool, int, int, TreeNode]:
            return (n.lock_ref > 0, n in self.wanted, self._evict_last(n), n.last_access, n.id, n)

        heap = [entry(n) for n in self.nodes() if can_go(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[-1]
            parent = _parent(node)
            freed += len(node)
            if node.on_device:
                self._free_host(node)
                continue
            self._leaving_host(node)
            self._remove(node)
            # a parent on the device is in the heap already; a host-only one may just have become a leaf
            if parent is not self.root and not parent.on_device and can_go(parent):
                heapq.heappush(heap, entry(parent))
        if freed:
            self.version += 1
        return freed

    def load_back(self, m: MatchResult) -> MatchResult:
        """Give the host-only part of ``m`` device pages (evicting others as needed; ``m.node`` must
        be locked) and queue the copies; returns the match on the device now. When the device cannot
        hold it, returns ``m``'s device part alone."""
        if m.host_node is None:
            return m
        nodes: list[TreeNode] = []
        node: TreeNode = m.host_node
        while node is not m.node:
            nodes.append(node)
            node = _parent(node)
        nodes.reverse()
        pages = m.host_len // self.page_size
        self.loading.update(nodes)  # their host pages stay while the device makes room
        try:
            short = pages - self.allocator.num_free_pages
            if short > 0:
                self.evict(short * self.page_size)
            dev = self.allocator.pages_to_slots(self.allocator.alloc_pages(pages))
        except OutOfPagesError:
            self.loading.difference_update(nodes)
            return MatchResult(m.slots, m.node, m.branch)
        start = 0
        for n in nodes:
            n.value = dev[start : start + len(n)]
            self.evictable_size += len(n)
            self._loads.append((n.host_value, n.value))
            self._blocks_event("stored", n)
            self.loaded_tokens += len(n)
            start += len(n)
        self.version += 1
        return MatchResult(np.concatenate([m.slots, dev]), nodes[-1], m.branch)

    def path_loading(self, node: TreeNode | None) -> bool:
        while self.loading and node is not None:
            if node in self.loading:
                return True
            node = node.parent
        return False

    def queued_copies(self) -> tuple[_Copies, _Copies]:
        """The write-backs and loads queued since the last ``take_transfers`` (for checks)."""
        return self._stores, self._loads

    def take_transfers(self) -> KVTransfers | None:
        """The copies queued since the last call (None: none), for the next step to run first."""
        if not self._stores and not self._loads:
            return None

        def cat(pairs: _Copies, i: int) -> npt.NDArray[np.int64]:
            return np.concatenate([p[i] for p in pairs]) if pairs else _EMPTY_SLOTS

        stores, loads = self._stores, self._loads
        out = KVTransfers(cat(stores, 0), cat(stores, 1), cat(loads, 0), cat(loads, 1))
        self._stores, self._loads = [], []
        self.loading, self.storing = set(), set()
        return out
