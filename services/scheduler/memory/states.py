"""StateTracker: a hybrid model's recurrent states on the scheduler's side, and the StatePlan of each
step (which state copies run before it, which snapshots it takes).

A running request's working state is its table row's slot (memory/state_pool.py). On the host,
per step:

* ``stores`` and ``loads`` (the host tier's snapshot slots, memory/hybrid_tiered_cache.py): snapshots
  the device pool evicted to the host, and host snapshots brought back to device slots for requests
  admitted at them. They run before everything else, stores first: a device slot a store reads may
  be the destination of a load, a copy or a cut of the same step.
* ``copies``: snapshots of requests that ended (HybridRadixCache.cache_finished_req): a row's state
  into a snapshot slot. They run first: the row may be handed to a new request in this very step.
* ``inits``: every request admitted since the last step starts from a copy: of the snapshot where
  its matched prefix ends, or of the all-zeros slot (nothing matched, or no prefix cache).
* ``cuts`` (prefill steps): the snapshots the step takes, each a request's state after so many of
  its tokens, written by the linear layers during the forward (model/linear_attention.py). Where:
  the policy below. Their slots are in flight until ``settle`` hands them to the tree after the
  step (or frees them, for a request retracted meanwhile).

The snapshot policy, for a prefill that extends a request from ``s`` to ``e`` tokens:

* the branch point: where its prompt leaves the tree's cached KV (``Req.branch_len``; when it leads
  followers held back to hit its prefix, where its prompt leaves theirs), so the next request that
  leaves there resumes from it: with a shared system prompt, from the third request on;
* the end of the prompt on a page boundary, one token short of it (a repeated prompt matches all
  but its last token): the next turn of a chat resumes from it;
* the end of each chunk of a chunked prefill: a later prompt that leaves this one's path resumes
  at most a chunk before where it leaves, already the second request of a shared system prompt
  (LRU keeps the pool bounded; the snapshots nobody resumes from age out first);
* every ``interval`` tokens of a long prompt (0: none).

A request's end adds one more (cache_finished_req): where its KV ends, if that is a page boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.batch import ForwardMode, ScheduleBatch
from radixserve.scheduler.memory.hybrid_cache import HybridRadixCache, has_snapshot
from radixserve.scheduler.memory.radix_cache import MatchResult, RadixCache, common_len
from radixserve.scheduler.req import Req

_NONE = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class StatePlan:
    """One step's state work, host side; the runner runs ``stores``, ``loads``, ``copies`` then ``inits``
    before the step."""

    stores: npt.NDArray[np.int64] = field(default_factory=lambda: _NONE)  # [state slots..., host slots...]
    loads: npt.NDArray[np.int64] = field(default_factory=lambda: _NONE)  # [host slots..., snapshot slots...]
    copies: npt.NDArray[np.int64] = field(default_factory=lambda: _NONE)  # [sources..., destinations...]
    inits: npt.NDArray[np.int64] = field(default_factory=lambda: _NONE)  # [sources..., destinations...]
    # prefill: per batch row, (offset in its extend, snapshot slot), offsets ascending
    cuts: list[list[tuple[int, int]]] = field(default_factory=list)
    taken: list[tuple[int, int, int]] = field(default_factory=list)  # (batch row, prefix length, slot)


class StateTracker:
    def __init__(self, cache: RadixCache, zero_slot: int, page_size: int, interval: int = 0) -> None:
        self.hybrid = cache if isinstance(cache, HybridRadixCache) else None  # None: no snapshots
        self.zero_slot = zero_slot
        self.page_size = page_size
        self.interval = interval - interval % page_size  # whole pages
        self.in_flight: set[int] = set()  # snapshot slots a step writes, not settled yet

    def admitted(self, req: Req, m: MatchResult) -> None:
        """``req`` got a row and the match ``m`` (on the device: a host part is loaded back by now, and
        ``m.node`` is the node it ended at): its state starts from ``m``'s snapshot, or zeros."""
        assert m.host_node is None and (not len(m.slots) or m.node.snapshot >= 0), "resumed, no snapshot"
        req.state_src = m.node.snapshot if len(m.slots) else self.zero_slot
        req.branch_len = m.branch

    def lead(self, req: Req, followers: Sequence[Req]) -> None:
        """``req`` computes a prefix that ``followers`` were held back to hit: snapshot where they
        leave it (the shortest such point, so all of them resume from it)."""
        ids = req.fill_ids()
        shared = min(common_len(ids, f.fill_ids(), self.page_size) for f in followers)
        if shared < req.seq_len:
            req.branch_len = max(req.branch_len, shared)

    def plan(self, batch: ScheduleBatch) -> StatePlan:
        plan = StatePlan()
        if batch.mode is ForwardMode.EXTEND:
            self._plan_extend(plan, batch)
        # Last: the cuts' snapshot slots may evict snapshots, whose queued copies then go (or become
        # stores from their rows, with the host tier).
        if self.hybrid is not None:
            plan.copies = self.hybrid.take_copies()
            plan.stores, plan.loads = self.hybrid.take_state_transfers()
        return plan

    def _plan_extend(self, plan: StatePlan, batch: ScheduleBatch) -> None:
        src, dst = [], []
        for i, (req, s, n) in enumerate(
            zip(batch.reqs, batch.prefix_lens.tolist(), batch.extend_lens.tolist(), strict=True)
        ):
            if req.state_src >= 0:  # its first step since admission
                assert req.req_pool_idx is not None
                src.append(req.state_src)
                dst.append(req.req_pool_idx)
                req.state_src = -1
            plan.cuts.append(self._cuts(plan, i, req, s, s + n))
        if src:
            plan.inits = np.array(src + dst, dtype=np.int64)

    def _cuts(self, plan: StatePlan, row: int, req: Req, s: int, e: int) -> list[tuple[int, int]]:
        if self.hybrid is None:
            return []
        cuts = []
        for p in self._points(req, s, e):
            slot = self.hybrid.alloc_snapshot()
            if slot is None:
                break  # every snapshot is in use: this step takes none
            self.in_flight.add(slot)
            cuts.append((p - s, slot))
            plan.taken.append((row, p, slot))
        return cuts

    def _points(self, req: Req, s: int, e: int) -> list[int]:
        """Where the prefill from ``s`` to ``e`` snapshots (page aligned, in ``(s, e]``)."""
        ps = self.page_size
        points = set()
        if s < req.branch_len <= e:
            points.add(req.branch_len)
        if e >= req.seq_len:  # the prompt's last step
            end = (req.seq_len - 1) - (req.seq_len - 1) % ps
            if end > s:
                points.add(end)
        elif e % ps == 0:  # a chunk of a longer prompt ends here: its KV goes to the tree now
            points.add(e)
        if self.interval:
            points.update(range(s - s % self.interval + self.interval, e + 1, self.interval))
        return sorted(points)

    def settle(self, batch: ScheduleBatch) -> None:
        """After ``batch``'s step: its snapshots to the tree, or freed where their request was
        retracted since (its results are void)."""
        assert self.hybrid is not None and batch.states is not None
        for row, length, slot in batch.states.taken:
            self.in_flight.discard(slot)
            req = batch.reqs[row]
            if req.retractions == batch.epochs[row]:
                self.hybrid.attach(req.fill_ids()[:length], slot)
            else:
                self.hybrid.snapshots.free(slot)

    def check(self) -> None:
        """Every snapshot slot has exactly one owner: the free list, a tree node or a step in flight;
        every node's snapshot count is its subtree's."""
        h = self.hybrid
        if h is None:
            return
        free, held = h.snapshots.free_slots(), set(h.held)
        owners = len(free) + len(held) + len(self.in_flight)
        assert len(set(free) | held | self.in_flight) == owners == h.snapshots.capacity, (
            f"snapshot slots: {len(free)} free + {len(held)} held + {len(self.in_flight)} in flight "
            f"!= {h.snapshots.capacity}"
        )
        assert set(h.copies) <= held, "a queued state copy into a snapshot no node holds"
        nodes = h.nodes()
        assert {n.snapshot for n in nodes if n.snapshot >= 0} == held
        for n in nodes:
            assert h.held.get(n.snapshot, n) is n
            below = has_snapshot(n) + sum(c.snaps_below for c in n.children.values())
            assert n.snaps_below == below, (n, n.snaps_below, below)
        h.check_host_snapshots()
