"""The radix cache's block events: what the cluster's prefix index learns of the tree.

Every full block of ``block_size`` tokens in the tree has a chained hash (radixserve.common.block_hash)
kept on the node its last token lives in. A node's blocks are reported at the best tier holding them
(``stored``: the device; ``stored_host``, ``stored_disk``: common/kv_tier.py; a cache with lower tiers
says which in ``_tier_event``) when it is created and whenever that tier changes, ``removed`` when it
leaves the tree, ``cleared`` when the tree is reset. ``block_snapshot`` is the same as a snapshot
(what a subscriber that fell behind gets, after ``cleared``); ``all_block_hashes`` lists the blocks.
Events are recorded once ``enable_block_events`` sets ``record_events``; a cache may hash blocks
before that (the disk tier names its files by them: memory/disk_cache.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.common.block_hash import chain

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from radixserve.scheduler.memory.radix_cache import TreeNode


class BlockEvents:
    """RadixCache's part that hashes blocks and records their events (memory/radix_cache.py)."""

    block_size: int  # 0: blocks are not hashed
    record_events: bool  # False: blocks may be hashed (the disk tier's names) but no events recorded
    _root_block_hash: int
    block_events: list[tuple[str, list[int]]]  # (kind, hashes): common/kv_tier.py's, "removed", "cleared"
    # The id of the disk directory whose blocks this cache reports as ``stored_disk`` ("": no disk
    # tier): a shared directory is one location of the prefix index, whichever pod wrote a block.
    disk_location = ""

    def nodes(self) -> list[TreeNode]:
        raise NotImplementedError

    def take_block_events(self) -> list[tuple[str, list[int]]]:
        events, self.block_events = self.block_events, []
        return events

    def all_block_hashes(self) -> list[int]:
        """Every block the tree holds, on any tier."""
        return [h for node in self.nodes() for h in node.blocks]

    def block_snapshot(self) -> list[tuple[str, list[int]]]:
        """Every block held, as the events that store each at its tier (a resync's snapshot, what a
        subscriber gets after ``cleared``): the tree's blocks by ``_tier_event``."""
        by_kind: dict[str, list[int]] = {}
        for node in self.nodes():
            if node.blocks:
                by_kind.setdefault(self._tier_event(node), []).extend(node.blocks)
        return list(by_kind.items())

    def _hash_blocks(self, leaf: TreeNode, tokens: npt.NDArray[np.int32]) -> None:
        """Hash the full blocks ending in the new ``leaf``; ``tokens`` is its whole path's key."""
        bs = self.block_size
        first, last = leaf.depth // bs + 1, (leaf.depth + len(leaf)) // bs  # block numbers (1-based)
        if last < first:
            return
        start = (first - 1) * bs
        assert leaf.parent is not None
        leaf.blocks = chain(self._block_hash_ending_at(leaf.parent, start), tokens[start : last * bs], bs)
        self._blocks_event("stored", leaf)

    def _blocks_event(self, kind: str, node: TreeNode) -> None:
        """Record ``kind`` for ``node``'s blocks (a hybrid's cache records fewer)."""
        if self.record_events and node.blocks:
            self.block_events.append((kind, node.blocks))

    def _tier_event(self, node: TreeNode) -> str:
        """The event that stores ``node``'s blocks at the best tier holding them (lower tiers: theirs)."""
        return "stored"

    def _block_hash_ending_at(self, node: TreeNode, end: int) -> int:
        """Hash of the block ending at ``end`` (a multiple of block_size) on ``node``'s path."""
        if end == 0:
            return self._root_block_hash
        while not node.depth < end <= node.depth + len(node):
            assert node.parent is not None, "walked past the root"
            node = node.parent
        bs = self.block_size
        return node.blocks[(end - (node.depth // bs + 1) * bs) // bs]
