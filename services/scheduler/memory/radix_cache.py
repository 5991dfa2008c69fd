"""Radix prefix cache over the paged KV pool.

Ownership of every KV page is unambiguous at all times. A request's token row in
the ReqToTokenPool is split at ``req.cached_len`` (a multiple of ``page_size``):

    token:   0 ............ cached_len ............... kv_len ..... alloc_len
             |<-- owned by the tree -->|<--- owned by the request (private) --->|
             |   locked via last_node  |   freed by the request when it ends    |

* Pages left of ``cached_len`` belong to tree nodes. The request holds a lock
  (``lock_ref`` on ``last_node`` and all its ancestors), so they cannot be evicted
  while it runs. They are freed only by ``evict``.
* Pages right of it belong to the request alone (its last page may be partial).
* ``insert`` hands pages from a request to the tree. When another request has
  inserted the same tokens first, the tree keeps its own pages and the caller's
  copies are duplicates: they are freed AND the request's row is rewritten to the
  tree's slots before anything else can read it (a row must never point at a freed
  page).

Keys are page aligned: a node's key length is a multiple of ``page_size``, nodes are
split only at page boundaries, and children are indexed by their first page.

Eviction takes unlocked leaves, least recently used first, except that nodes on the prefixes
waiting requests matched (``want``, set by the scheduler each prefill step) go after every other
leaf: evicting one of those costs its whole prefill again when the request is admitted.

Accounting: ``free + evictable + protected + sum(private pages of live requests)``
equals the pool's capacity after every operation (``KVCacheManager.check``).

Host tier: memory/tiered_cache.py (TieredRadixCache) keeps a node's KV on the host too, or only.

Block events (for the cluster's prefix index; off unless ``enable_block_events``): memory/block_events.py.
A split moves a node's block hashes with their tokens, so the tree's hashes are, at all times,
exactly the full blocks it holds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.block_events import BlockEvents
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from radixserve.scheduler.memory.tiered_cache import KVTransfers
    from radixserve.scheduler.req import Req

_EMPTY_SLOTS = np.zeros(0, dtype=np.int64)
_node_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "blocks", "children", "depth", "host_snapshot", "host_value", "id", "key", "last_access",
        "lock_ref", "parent", "snaps_below", "snapshot", "value",
    )  # fmt: skip

    def __init__(
        self, key: npt.NDArray[np.int32], value: npt.NDArray[np.int64], parent: TreeNode | None
    ) -> None:
        self.key = key  # token ids (int32), length a multiple of page_size
        self.value = value  # device KV slots (int64), same length; empty: not on the device
        self.host_value = _EMPTY_SLOTS  # host KV slots (int64); empty: not on the host
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0  # logical time of the last match or insert through this node
        self.id = next(_node_ids)
        self.depth = 0  # tokens before this node on its path
        self.blocks: list[int] = []  # hashes of the full blocks whose last token is in this node
        # Hybrid models (memory/hybrid_cache.py): the state snapshot slot at this node's end (-1:
        # none), its host snapshot slot (-1: none), and how many nodes of its subtree (itself
        # included) hold a snapshot on either tier.
        self.snapshot = self.host_snapshot = -1
        self.snaps_below = 0

    def __len__(self) -> int:
        return len(self.key)

    @property
    def on_device(self) -> bool:
        return len(self.value) > 0

    @property
    def on_host(self) -> bool:
        return len(self.host_value) > 0

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _parent(node: TreeNode) -> TreeNode:
    """The parent of ``node``, which is not the root (every walk up a path stops at the root)."""
    assert node.parent is not None, "walked past the root"
    return node.parent


class MatchResult(NamedTuple):
    slots: npt.NDArray[np.int64]  # KV slots of the matched prefix; len(slots) is the match length
    node: TreeNode  # deepest matched node: the one to lock
    branch: int = 0  # hybrids: where the tokens leave the tree's KV (>= len(slots); memory/hybrid_cache.py)
    # Host tier: the deepest matched node when the match runs on past ``node`` through host-only
    # nodes, and how many tokens those hold (``load_back`` brings them to the device).
    host_node: TreeNode | None = None
    host_len: int = 0

    @property
    def length(self) -> int:
        """Tokens matched on every tier."""
        return len(self.slots) + self.host_len


class InsertResult(NamedTuple):
    present_len: int  # leading tokens that were already cached (caller's slots there are duplicates)
    node: TreeNode  # node ending exactly at the inserted key's end
    slots: npt.NDArray[np.int64]  # the tree's slots for the whole key


def common_len(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32], page_size: int) -> int:
    """Length of the common prefix of a and b, floored to a page boundary."""
    n = min(len(a), len(b))
    if a[:n].tobytes() != b[:n].tobytes():  # memcmp first: most compares match fully
        n = int(np.flatnonzero(a[:n] != b[:n])[0])
    return n - n % page_size


class RadixCache(BlockEvents):
    """Prefix cache: token sequences -> KV slots, LRU eviction of unlocked leaves (wanted ones last)."""

    disabled = False

    # The host tier (memory/tiered_cache.py) adds to these; without it everything is on the device.
    host_size = 0  # tokens in nodes with a host copy
    written_back_tokens = loaded_tokens = 0  # tokens copied to the host and back, all told

    def __init__(self, allocator: PagedAllocator, req_to_token: ReqToTokenPool) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size
        self.block_size = 0  # 0: blocks are not hashed
        self.record_events = False
        self._root_block_hash = 0
        self.block_events: list[tuple[str, list[int]]] = []
        self.reset()

    def enable_block_events(self, block_size: int, root_block_hash: int) -> None:
        """Record stored/removed block hashes from now on (see the module docstring)."""
        if self.total_size:
            raise RuntimeError("enable block events on an empty cache")
        self.block_size = block_size
        self._root_block_hash = root_block_hash
        self.record_events = True

    def reset(self) -> None:
        """Drop every node. Only valid when no request holds a lock."""
        self.root = TreeNode(np.zeros(0, dtype=np.int32), _EMPTY_SLOTS, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0  # logical clock for LRU: deterministic, no timer-resolution ties
        # Bumped by every insert that adds tokens and every eviction: a MatchResult taken at an
        # older version may be shorter than the longest match now, or name evicted nodes.
        self.version = 0
        self.evictable_size = 0  # tokens in nodes with lock_ref == 0
        self.protected_size = 0  # tokens in nodes with lock_ref > 0
        # Nodes on the cached prefixes that waiting requests matched (``want``): evicted last, and
        # the scheduler keeps them out of what it admits new work into.
        self.wanted: set[TreeNode] = set()
        if self.record_events:
            self.block_events.append(("cleared", []))

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ------------------------------------------------------------------ match
    def _child_key(self, tokens: npt.NDArray[np.int32]) -> bytes:
        return tokens[: self.page_size].tobytes()

    def _walk(self, tokens: npt.NDArray[np.int32]) -> tuple[TreeNode, int, list[TreeNode]]:
        """Follow ``tokens`` down as far as they match (page aligned), touching the path.

        A match that ends inside a node splits it there, so the returned node ends exactly at
        the returned length. Returns (node, matched length, the nodes along the path).
        """
        ps = self.page_size
        node, pos, now = self.root, 0, self._tick()
        path: list[TreeNode] = []
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens[pos:]))
            if child is None:
                break
            child.last_access = now
            n = common_len(child.key, tokens[pos:], ps)
            if n < len(child):
                child = self._split(child, n)
            path.append(child)
            node, pos = child, pos + n
        return node, pos, path

    def match_prefix(self, tokens: npt.NDArray[np.integer]) -> MatchResult:
        """Longest cached prefix of ``tokens`` (page aligned); splits a node a match ends inside.

        ``slots``/``node``: its device part; ``host_node``/``host_len``: the host-only part after it.
        """
        ids = np.asarray(tokens, dtype=np.int32)
        _, _, path = self._walk(ids[: len(ids) - len(ids) % self.page_size])
        on_device = sum(1 for n in path if n.on_device)  # a prefix of the path (parents first)
        node = path[on_device - 1] if on_device else self.root
        host_len = sum(len(n) for n in path[on_device:])
        host_node = path[-1] if host_len else None
        if on_device <= 1:
            slots = path[0].value if on_device else _EMPTY_SLOTS
        else:
            slots = np.concatenate([n.value for n in path[:on_device]])
        return MatchResult(slots, node, 0, host_node, host_len)

    def match_kv(self, tokens: npt.NDArray[np.integer]) -> MatchResult:
        """The longest prefix whose KV is cached (``match_prefix`` itself, but for a hybrid's cache)."""
        return self.match_prefix(tokens)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; returns the new upper node."""
        assert child.parent is not None and 0 < n < len(child) and n % self.page_size == 0
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.host_value = child.host_value[:n]
        child.host_value = child.host_value[n:]
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.snaps_below = child.snaps_below  # the same subtree (its snapshot stays with ``child``)
        if child in self.wanted:
            self.wanted.add(upper)
        upper.children = {self._child_key(child.key[n:]): child}
        upper.depth = child.depth
        child.depth += n
        if child.blocks:
            bs = self.block_size
            k = (upper.depth + n) // bs - upper.depth // bs  # blocks ending in the upper part
            upper.blocks, child.blocks = child.blocks[:k], child.blocks[k:]
        child.parent.children[self._child_key(child.key)] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        return upper

    # ----------------------------------------------------------------- insert
    def insert(self, tokens: npt.NDArray[np.integer], slots: npt.NDArray[np.integer]) -> InsertResult:
        """Cache ``tokens`` whose KV sits in ``slots``. Call only after the KV is written.

        The tree takes ownership of the slots past ``present_len``; the caller still owns
        (and must free) its slots in ``[its own cached prefix, present_len)``.
        """
        ps = self.page_size
        ids = np.asarray(tokens, dtype=np.int32)
        if len(ids) % ps or len(ids) != len(slots):
            raise ValueError("insert needs a page-aligned key and one slot per token")
        node, pos, path = self._walk(ids)
        present, start = pos, 0
        for n in path:
            if not n.on_device:  # host-only (and so is the rest): it takes the caller's pages
                present = min(present, start)
                n.value = np.asarray(slots[start : start + len(n)], dtype=np.int64).copy()
                self.evictable_size += len(n)
                self._blocks_event("stored", n)
                self.version += 1
            start += len(n)
        parts = [n.value for n in path]
        if pos < len(ids):
            leaf = TreeNode(ids[pos:].copy(), np.asarray(slots[pos:], dtype=np.int64).copy(), node)
            leaf.last_access = self._clock
            leaf.depth = pos
            if self.block_size:
                self._hash_blocks(leaf, ids)
            node.children[self._child_key(leaf.key)] = leaf
            self.evictable_size += len(leaf)
            self.version += 1
            parts.append(leaf.value)
            node = leaf
            self._inserted(leaf)
        tree_slots = np.concatenate(parts) if parts else _EMPTY_SLOTS
        return InsertResult(present, node, tree_slots)

    # ------------------------------------------------------------ lock/unlock
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node)
                self.protected_size += len(node)
            node.lock_ref += 1
            node = _parent(node)

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node)
                self.evictable_size += len(node)
            node = _parent(node)

    # ------------------------------------------------------------------ evict
    def want(self, nodes: Iterable[TreeNode]) -> None:
        """Mark the paths to ``nodes`` (the ends of waiting requests' matches) as wanted, replacing
        the previous marks."""
        wanted: set[TreeNode] = set()
        for node in nodes:
            while node is not self.root and node not in wanted:
                wanted.add(node)
                node = _parent(node)
        self.wanted = wanted

    def wanted_evictable_size(self) -> int:
        """Device tokens in wanted nodes that nothing locks: evictable, but waiting requests will hit them."""
        return sum(len(n) for n in self.wanted if n.lock_ref == 0 and n.on_device)

    def evict(self, num_tokens: int, write_back: bool = True) -> int:
        """Free at least ``num_tokens`` device tokens from unlocked device leaves (no child on the
        device): leaves nobody waits for first, each group least recently used first. With a host
        tier (and ``write_back``), a leaf's KV is copied to the host first and the node stays.

        Returns the number of tokens freed (less when not enough is evictable).
        """
        if num_tokens <= 0:
            return 0
        wanted = self.wanted

        def entry(n: TreeNode) -> tuple[bool, bool, int, int, TreeNode]:
            return (n in wanted, self._evict_last(n), n.last_access, n.id, n)

        heap = [entry(n) for n in self._device_leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)[-1]
            parent = _parent(leaf)
            if write_back:
                self._leaving_device(leaf)
            self._free_device(leaf)
            if not leaf.on_host:
                self._remove(leaf)
            freed += len(leaf)
            if parent is not self.root and parent.lock_ref == 0 and not self._device_children(parent):
                heapq.heappush(heap, entry(parent))
        if freed:
            self.version += 1
        return freed

    def _device_children(self, node: TreeNode) -> bool:
        return any(c.on_device for c in node.children.values())

    def _device_leaves(self) -> list[TreeNode]:
        return [n for n in self.nodes() if n.on_device and not self._device_children(n)]

    def _free_device(self, node: TreeNode) -> None:
        """``node`` leaves the device (unlocked)."""
        self.allocator.free_slots(node.value)
        node.value = _EMPTY_SLOTS
        self.evictable_size -= len(node)

    def _remove(self, node: TreeNode) -> None:
        """Take ``node`` and its subtree (host-only, if any) out of the tree."""
        del _parent(node).children[self._child_key(node.key)]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            assert not n.on_device, "removed a node the device still uses"
            self.wanted.discard(n)
            self._evicting(n)
            self._blocks_event("removed", n)

    # ---------------------------------------------------- the host tier's hooks
    def _inserted(self, leaf: TreeNode) -> None:
        """``leaf`` is new in the tree, its KV written (insert follows the forward)."""

    def _leaving_device(self, leaf: TreeNode) -> None:
        """``leaf``'s device pages are about to be freed by an eviction."""

    def can_resume(self, m: MatchResult) -> bool:
        """Whether ``load_back`` could resume ``m`` at its end now, room for its KV aside (a hybrid's
        host-only snapshot needs a device snapshot slot: memory/hybrid_tiered_cache.py)."""
        return True

    def needs_load(self, m: MatchResult) -> bool:
        """Whether ``m`` has a part on a lower tier (KV, or a hybrid's state snapshot) to load back."""
        return m.host_node is not None

    def load_back(self, m: MatchResult) -> MatchResult:
        """``m`` with any part on a lower tier brought to the device (memory/tiered_cache.py)."""
        return m

    def evict_host(self, num_tokens: int, keep: TreeNode | None = None) -> int:
        return 0

    def take_transfers(self) -> KVTransfers | None:
        """Copies between tiers for the next step to run first (memory/tiered_cache.py)."""
        return None

    def path_loading(self, node: TreeNode | None) -> bool:
        """Whether the path to ``node`` holds pages a queued load writes (memory/tiered_cache.py)."""
        return False

    # ---------------------------------------------------- the disk tier's hooks
    def read_disk(self, tokens: npt.NDArray[np.integer], m: MatchResult | None = None) -> bool:
        """Whether the blocks past ``m`` are on disk, their read started (memory/disk_cache.py)."""
        return False

    def poll(self) -> None:
        """Take finished disk reads into the tree (memory/disk_cache.py)."""

    def await_disk_read(self, timeout_s: float) -> None:
        """Sleep until a disk read in flight lands, ``timeout_s`` at most (memory/disk_cache.py)."""

    # ------------------------------------------------------- the hybrids' hooks
    def _evict_last(self, leaf: TreeNode) -> bool:
        """Among equally wanted leaves, whether ``leaf`` goes after those that return False."""
        return False

    def _evicting(self, leaf: TreeNode) -> None:
        """``leaf`` leaves the tree (its device pages are freed already)."""

    def nodes(self) -> list[TreeNode]:
        """Every node but the root (for checks and stats)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------- request-level protocol
    def cache_unfinished_req(self, req: Req, upto: int) -> None:
        """Hand the page-aligned part of ``req``'s first ``upto`` tokens (KV written) to the tree;
        keep it locked.

        Called after every prefill (chunk) so that later requests, and this request's next
        chunk, hit it.
        """
        self._take_written(req, upto)

    def cache_finished_req(self, req: Req) -> None:
        """Cache what the request wrote, free its private pages, release its lock and row."""
        self._take_written(req)
        self._free_private(req)
        assert req.last_node is not None
        self.unlock(req.last_node)
        self._drop_row(req)

    def _drop_row(self, req: Req) -> None:
        """The request holds no KV any more: give back its table row."""
        assert req.req_pool_idx is not None
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx = req.last_node = None
        req.cached_len = req.kv_len = req.alloc_len = 0

    def _take_written(self, req: Req, upto: int | None = None) -> None:
        assert req.req_pool_idx is not None and req.last_node is not None
        n = min(req.kv_len if upto is None else upto, req.known_len)  # never a placeholder in a key
        aligned = n - n % self.page_size
        if aligned <= req.cached_len:
            return
        row = req.req_pool_idx
        slots = self.req_to_token.read(row, 0, aligned)
        res = self.insert(req.fill_ids()[:aligned], slots)
        if res.present_len > req.cached_len:
            # Another request cached these tokens first: ours are duplicates. Point the row at
            # the tree's copy, then free ours.
            dup = slots[req.cached_len : res.present_len]
            self.req_to_token.write(row, req.cached_len, res.slots[req.cached_len : res.present_len])
            self.allocator.free_slots(dup)
        self.lock(res.node)
        self.unlock(req.last_node)
        req.last_node = res.node
        req.cached_len = aligned

    def _free_private(self, req: Req) -> None:
        if req.alloc_len > req.cached_len:
            assert req.req_pool_idx is not None
            ps = self.page_size
            slots = self.req_to_token.read(req.req_pool_idx, req.cached_len, req.alloc_len)
            self.allocator.free_pages(slots[::ps] // ps)
