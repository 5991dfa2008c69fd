"""SchedulePolicy: the order in which waiting requests are offered to the PrefillAdder.

* ``fcfs``: arrival order.
* ``lpm``: longest cached prefix first (ties by arrival), so requests that hit run while
  their prefix is still cached.
* ``dfs-weight``: walk the cache tree depth first, heaviest subtree (most waiting
  requests) first, a node's own requests after its subtrees, so requests sharing a
  prefix run together and requests with no cached prefix come last.

Two rules sit on top of every policy:

* Fairness: a request that has waited longer than ``fairness_timeout`` goes first,
  oldest first, whatever its prefix (time it spent running before a retraction does
  not count as waiting). This bounds LPM's starvation of requests with
  no cached prefix. Requests due soon (waited more than ``1 - fairness_lead`` of the
  timeout) come next, also oldest first: admission stops at the first request that
  does not fit, so younger requests stop taking the memory a request will need when
  it falls due, and it does not fall due stuck behind long decodes.
* In-batch de-duplication (lpm, dfs-weight): when several waiting requests share a
  prefix nobody has cached yet, only the first is offered this step; the rest are
  held back one step and then hit the prefix the first one cached. ``followers`` names
  them for the PrefillAdder, which starts the first only with room for them.

Cache-aware ordering needs a prefix match per waiting request; above
``lpm_fcfs_threshold`` waiting requests the sort costs more than it wins and the
order falls back to fcfs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.manager import KVCacheManager
from radixserve.scheduler.memory.radix_cache import TreeNode
from radixserve.scheduler.req import Req


class SchedulePolicy:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.cache_aware = config.policy != "fcfs" and not config.memory.disable_radix_cache
        # From the last ``order``: id of a request offered first for an uncached shared prefix ->
        # the requests held back to hit it (de-duplication below).
        self.followers: dict[int, list[Req]] = {}

    def due_soon(self, req: Req, now: float) -> bool:
        """``req`` is overdue or due soon: the fairness bound serves it first."""
        t = self.config.fairness_timeout
        return t is not None and now - req.queue_time > t * (1.0 - self.config.fairness_lead)

    def fairness_tiers(self, waiting: Sequence[Req], now: float) -> tuple[list[Req], list[Req], list[Req]]:
        """``waiting`` (in arrival order) split into overdue, due soon (within the lead) and the rest."""
        t = self.config.fairness_timeout
        if t is None:
            return [], [], list(waiting)
        overdue: list[Req] = []
        due: list[Req] = []
        rest: list[Req] = []
        for r in waiting:
            (rest if not self.due_soon(r, now) else overdue if now - r.queue_time > t else due).append(r)
        return overdue, due, rest

    def order(self, waiting: Sequence[Req], now: float, in_prefill: Sequence[Req] = ()) -> list[Req]:
        """Waiting requests in the order to offer them; ``waiting`` is in arrival order.

        ``in_prefill`` are requests whose prefill is under way (a chunked request): waiting
        requests that share their uncached prefix are held back too.
        """
        overdue, due, rest = self.fairness_tiers(waiting, now)
        self.followers = {}
        return overdue + due + self._order_rest(rest, in_prefill)

    def _order_rest(self, waiting: Sequence[Req], in_prefill: Sequence[Req]) -> list[Req]:
        if not self.cache_aware or len(waiting) > self.config.lpm_fcfs_threshold or len(waiting) < 1:
            return list(waiting)
        nodes = {}
        for r in waiting:
            nodes[r] = self.kv.match(r).node
        if self.config.policy == "lpm":
            ordered = sorted(waiting, key=lambda r: -r.match_len)  # stable: ties keep arrival order
        else:
            ordered = self._dfs_weight(waiting, nodes)
        return self._dedup(ordered, nodes, in_prefill)

    @staticmethod
    def _dfs_weight(waiting: Sequence[Req], nodes: dict[Req, TreeNode]) -> list[Req]:
        at_node: dict[TreeNode, list[Req]] = defaultdict(list)
        weight: dict[TreeNode, int] = defaultdict(int)
        for r in waiting:
            node: TreeNode | None = nodes[r]
            at_node[nodes[r]].append(r)
            while node is not None:
                weight[node] += 1
                node = node.parent
        kids: dict[TreeNode, list[TreeNode]] = defaultdict(list)
        root = None
        for node in weight:
            if node.parent is None:
                root = node
            else:
                kids[node.parent].append(node)
        assert root is not None  # every path above ends at the root
        # Post-order: a node's heaviest subtrees first, then the requests that end on it
        # (requests with no cached prefix end on the root and so come last).
        out: list[Req] = []
        stack: list[tuple[TreeNode, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at_node.get(node, ()))
                continue
            stack.append((node, True))
            # Push lightest first so the heaviest subtree is popped next.
            stack.extend((k, False) for k in sorted(kids.get(node, ()), key=lambda n: (weight[n], -n.id)))
        return out

    def _dedup(self, ordered: list[Req], nodes: dict[Req, TreeNode], in_prefill: Sequence[Req]) -> list[Req]:
        k = self.config.dedup_min_tokens
        if k <= 0:
            return ordered
        # Two requests share >= k uncached tokens iff they end their match on the same node
        # and their next k tokens are equal.
        seen: dict[tuple[int, bytes], Req | None] = {}  # key -> the request offered for it
        for r in in_prefill:
            if r.last_node is not None and r.seq_len - r.cached_len >= k:
                seen[(r.last_node.id, r.fill_ids()[r.cached_len : r.cached_len + k].tobytes())] = None
        out = []
        for r in ordered:
            if r.seq_len - r.match_len > k:
                key = (nodes[r].id, r.fill_ids()[r.match_len : r.match_len + k].tobytes())
                if key in seen:
                    first = seen[key]
                    if first is not None:
                        self.followers.setdefault(id(first), []).append(r)
                    continue  # held back one step: it will hit what the first one caches
                seen[key] = r
            out.append(r)
        return out
