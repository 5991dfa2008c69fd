"""DiskTieredCache: the tiered radix cache with a disk tier under the host tier (docs/architecture.md,
"KV tiers"; the files: memory/disk_store.py; the threads and copies: memory/disk_tier.py).

Disk holds *blocks* (``block_size`` tokens, a multiple of the page size) named by their chained
hashes, so every node is hashed (block events or not). Writing down: when the host tier drops a
host-only leaf, the blocks that lie whole in it are captured (written by the writer thread) and the
node leaves the tree: the directory's index finds it again by hash (simpler than a disk-resident
node, and the same path serves another scheduler's blocks and a restart's). Its blocks are then
``stored_disk`` (block events), the rest ``removed``. Reading: ``match_prefix`` goes on past the
tree's match, hashing the prompt's next blocks and looking them up on disk; a hit is read by the
reader thread while the request waits (``read_disk``: not admitted, the others run), and
``poll`` turns a finished read into a host-only node whose pages the step's copies fill before any
load reads them: from there it is a host hit. A block a read could not check is a miss (counted,
its file deleted); the request then computes it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixserve.common.block_hash import chain
from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.disk_tier import Capture, DiskTier, Fill, ReadJob, ReadResult, StepOps
from radixserve.scheduler.memory.radix_cache import _EMPTY_SLOTS, MatchResult, TreeNode
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.memory.tiered_cache import KVTransfers, TieredRadixCache, _without


class DiskTieredCache(TieredRadixCache):
    def __init__(
        self,
        allocator: PagedAllocator,
        req_to_token: ReqToTokenPool,
        host: PagedAllocator,
        disk: DiskTier,
        write_through: bool = False,
    ) -> None:
        if disk.block_size % allocator.page_size:
            raise ValueError("the disk tier's block size must be a multiple of the page size")
        self.disk = disk
        self._skip: set[int] = set()  # blocks read whose result found no host room: not read again
        super().__init__(allocator, req_to_token, host, write_through)
        self.block_size = disk.block_size  # hashed for the disk; recorded once block events are on
        self._root_block_hash = disk.store.root_hash
        self.disk_location = disk.store.dir_id  # the prefix index's location of its disk-only blocks

    def reset(self) -> None:
        super().reset()
        self._captures: list[Capture] = []
        self._fills: list[Fill] = []
        self.filling: set[TreeNode] = set()  # host-only nodes whose pages a queued fill writes
        # Every block hash the tree holds, on any tier (kept by the hooks below: ``poll`` asks per
        # hash, without walking the tree). A set: a block's hash names its whole prefix, which one
        # node holds.
        self._held: set[int] = set()

    def enable_block_events(self, block_size: int, root_block_hash: int) -> None:
        """The blocks events name are the disk's: the prefix index's size and model root."""
        if block_size % self.page_size:
            ps = self.page_size
            raise ValueError(f"--block-size {block_size}: the disk tier needs a multiple of page_size {ps}")
        super().enable_block_events(block_size, root_block_hash)
        self.disk.rehash(block_size, root_block_hash)

    def block_snapshot(self) -> list[tuple[str, list[int]]]:
        """The tree's blocks by tier, and the directory's blocks it does not hold as ``stored_disk``
        (a resync or a restart announces what the files hold: a restarted pod starts warm)."""
        events = super().block_snapshot()
        if not self.disk.off:
            on_disk = [h for h in self.disk.store.hashes() if h not in self._held]
            if on_disk:
                events.append(("stored_disk", on_disk))
        return events

    # ------------------------------------------------------- the base's hooks
    def _split(self, child: TreeNode, n: int) -> TreeNode:
        upper = super()._split(child, n)
        if child in self.filling:
            self.filling.add(upper)
        return upper

    def _inserted(self, leaf: TreeNode) -> None:
        super()._inserted(leaf)
        self._held.update(leaf.blocks)

    def _evicting(self, leaf: TreeNode) -> None:
        self._held.difference_update(leaf.blocks)
        super()._evicting(leaf)

    def _free_host(self, node: TreeNode) -> None:
        if node in self.filling:  # a queued fill of its pages: dropped with them
            self._fills = _without(self._fills, node.host_value, 0)
            self.filling.discard(node)
        super()._free_host(node)

    def _leaving_host(self, leaf: TreeNode) -> None:
        """Capture the blocks that lie whole in ``leaf`` for the disk (none while its host pages are
        not written yet: a write-back queued; a fill queued means they came from disk)."""
        bs = self.block_size
        if self.disk.off or leaf in self.storing or not leaf.blocks:
            return
        first = leaf.depth // bs + 1  # the block number (1-based) of leaf.blocks[0]
        written: list[tuple[int, npt.NDArray[np.int32]]] = []
        written_already: list[int] = []
        rest: list[int] = []
        slots: list[npt.NDArray[np.int64]] = []
        for i, h in enumerate(leaf.blocks):
            start = (first + i - 1) * bs - leaf.depth  # in the leaf
            on_disk = start >= 0 and self.disk.store.indexed(h)
            if start < 0 or leaf in self.filling or on_disk:  # began in the parent (not written)
                (written_already if on_disk else rest).append(h)
                continue
            written.append((h, leaf.key[start : start + bs]))
            slots.append(leaf.host_value[start : start + bs])
        if written:
            self._captures.append((np.concatenate(slots), written))
        self._held.difference_update(leaf.blocks)  # the leaf leaves the tree next
        leaf.blocks = [h for h, _ in written] + written_already
        self._blocks_event("stored_disk", leaf)
        leaf.blocks = rest  # the base records them removed

    # ----------------------------------------------------------- matching
    def read_disk(self, tokens: npt.NDArray[np.integer], m: MatchResult | None = None) -> bool:
        """Whether the blocks past the tree's match ``m`` of ``tokens`` (default: matched now) are on
        disk, so that the request waits for them; starts their read unless one is in flight. The
        scheduler asks only for a request it would admit: reading for the whole queue would evict
        the reads from the host before their requests come, and hashing past every waiting
        request's match each step would cost for nothing. Reads in flight are held to half the
        host tier."""
        if self.disk.off:
            return False
        ids = np.asarray(tokens, dtype=np.int32)
        n, job = self._disk_part(m if m is not None else super().match_prefix(ids), ids)
        reading = len(self.disk.reading)
        if job is not None and not (reading and (reading + len(job.hashes)) * self.block_size > self.room):
            self.disk.submit_read(job)  # (else it waits for the reads in flight, and reads after)
        return n > 0

    @property
    def room(self) -> int:
        """Tokens a request may wait to read (its host part included), and all reads in flight: half
        the host tier (a prefix the host cannot hold at once would evict its first blocks before its
        load)."""
        return self.host.capacity_tokens // 2

    def _disk_part(self, m: MatchResult, ids: npt.NDArray[np.int32]) -> tuple[int, ReadJob | None]:
        """Tokens after ``m`` on disk, and the read that brings them (None: in flight already)."""
        bs, start = self.block_size, m.length
        k = start // bs  # the block that holds the first token past the match
        if k >= len(ids) // bs:
            return 0, None
        node = m.host_node or m.node
        prev = self._block_hash_ending_at(node, k * bs) if k else self._root_block_hash
        room = (self.room - m.host_len) // bs
        hashes: list[int] = []
        for b in range(k, min(len(ids) // bs, k + max(room, 0))):
            h = chain(prev, ids[b * bs : (b + 1) * bs], bs)[0]
            if h in self.disk.reading:
                return (b + 1) * bs - start, None  # wait for the read in flight
            if h in self._skip or not self.disk.store.has(h):
                break
            hashes.append(h)
            prev = h
        if not hashes:
            return 0, None
        end = (k + len(hashes)) * bs
        return end - start, ReadJob(ids[:end].copy(), start, hashes)

    def await_disk_read(self, timeout_s: float) -> None:
        self.disk.await_read(timeout_s)

    def poll(self) -> None:
        """Take the finished reads into the tree (host-only nodes, their fills queued)."""
        done = self.disk.take_done()
        for res in done:
            self.disk.reading.difference_update(res.job.hashes)
            if res.kv is not None:
                self._insert_read(res)
        removed = self.disk.take_removed()
        if removed and self.record_events:
            gone = TreeNode(np.zeros(0, dtype=np.int32), _EMPTY_SLOTS, None)
            gone.blocks = [h for h in removed if h not in self._held]  # on no tier of this scheduler now
            self._blocks_event("removed", gone)
        if done:
            self.version += 1  # matches taken before wait for nothing now

    def _insert_read(self, res: ReadResult) -> None:
        bs, ps, job = self.block_size, self.page_size, res.job
        first = job.start - job.start % bs  # where the read's KV starts
        end = first + res.blocks * bs
        node, pos, _ = self._walk(job.tokens[:end])
        if pos >= end or pos < first:
            return  # the tree holds it by now, or lost what it hangs from
        pages = (end - pos) // ps
        short = pages - self.host.num_free_pages
        if short > 0:
            self.evict_host(max(short, self.host.num_pages // 64) * ps, keep=node)
        if self.host.num_free_pages < pages:
            self._skip.update(job.hashes)
            return
        self._skip.clear()
        leaf = TreeNode(job.tokens[pos:end].copy(), _EMPTY_SLOTS, node)
        leaf.host_value = self.host.pages_to_slots(self.host.alloc_pages(pages))
        leaf.depth, leaf.last_access = pos, self._clock
        leaf.blocks = [h for i, h in enumerate(job.hashes[: res.blocks]) if first + (i + 1) * bs > pos]
        node.children[self._child_key(leaf.key)] = leaf
        self.host_size += len(leaf)
        self._held.update(leaf.blocks)
        assert res.kv is not None
        self._fills.append((leaf.host_value, res.kv[:, pos - first :]))
        self.filling.add(leaf)
        self.disk.read_tokens += len(leaf)
        self._blocks_event("stored_host", leaf)

    # ------------------------------------------------------------ the copies
    def take_transfers(self) -> KVTransfers | None:
        t = super().take_transfers()
        if not self._captures and not self._fills:
            return t
        seq = self.disk.seal(StepOps(self._captures, self._fills))
        self._captures, self._fills, self.filling = [], [], set()
        base = t if t is not None else KVTransfers(_EMPTY_SLOTS, _EMPTY_SLOTS, _EMPTY_SLOTS, _EMPTY_SLOTS)
        return base._replace(disk_seq=np.array([seq], dtype=np.int64))

    def forget_captures(self) -> None:
        """Drop the blocks queued for the disk (what the engine's warm-up left)."""
        self._captures = []

    def check_disk(self) -> None:
        """Queued fills write only pages of the nodes they were queued for; the disk's bound holds."""
        if self._fills:
            slots = np.concatenate([s for s, _ in self._fills])
            mine = np.concatenate([n.host_value for n in self.filling] + [_EMPTY_SLOTS])
            assert len(np.unique(slots)) == len(slots) and np.isin(slots, mine).all(), "a fill lost its node"
        for n in self.filling:
            assert n.on_host, f"{n!r}: a queued fill of a node off the host"
        assert self._held == set(self.all_block_hashes()), "the held blocks are not the tree's"
        self.disk.check()
