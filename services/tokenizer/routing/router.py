"""The routing policies: which scheduler pod gets a request (the pods themselves: scheduler_pool.py).

Routers share one small interface (``choose``); ``cache-aware`` is the default:

    hashes  = chained block hashes of the prompt (radixserve.common.block_hash)
    matched = per pod, leading blocks it holds, each at the best tier it can load it from (its
              device, its host memory, its disk or the disk directory it shares): the prefix index
              (Redis or in-memory), or what this router recently sent there (on the device: a burst
              sharing a new prefix lands together before the first prefill has published anything)
    score   = per pod, the sum of its matched blocks' tier weights (device 1.0, host 0.8, disk 0.5:
              --tier-weight-*): a prefix loaded from a lower tier saves its prefill, but the load costs
    if nobody holds any block: among the pods whose KV has room for it (working set + prompt
              within ``kv_fill`` of the pod's KV), the least busy (running + waiting as reported,
              plus what this gateway sent since that report), then the one with the smallest
              working set (the prefix blocks this router sent it in the last ``working_set_s``; a
              request's own unshared tail does not count)
    else: the best score (ties: least loaded), unless that pod is out of balance with the least
              loaded one (busy - min > abs AND busy > rel x min): then the least loaded

If the index fails (Redis down), routing degrades to least-load with a warning and retries the
index after ``retry_s``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.common.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from radixserve.common.kv_tier import TierMatch, TierWeights
from radixserve.common.prefix_index import PrefixIndex
from radixserve.common.service_config import ROUTING_DEFAULTS as ROUTING
from radixserve.common.service_config import RoutingConfig
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle

log = logging.getLogger(__name__)
_WEIGHTS = ROUTING.tier_weights()


@dataclass(slots=True)
class Decision:
    pod: str
    reason: str  # prefix | balance | no-match | index-down | policy
    matched_blocks: int  # the chosen pod's leading blocks, on any tier
    seconds: float
    matched: TierMatch = field(default_factory=TierMatch)  # the same by tier
    score: float = 0.0  # their worth (the tier weights')


class Router(Protocol):
    name: str
    decisions: deque[Decision]  # the last decisions, newest last (the gateway reads the one just made)

    def choose(self, input_ids: Sequence[int], candidates: Sequence[SchedulerHandle]) -> SchedulerHandle: ...


class _Recorder:
    """The last decisions, for metrics, benchmarks and tests."""

    def __init__(self) -> None:
        self.decisions: deque[Decision] = deque(maxlen=100_000)

    def record(self, d: Decision) -> None:
        self.decisions.append(d)


class RoundRobinRouter(_Recorder):
    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._n = itertools.count()

    def choose(self, input_ids: Sequence[int], candidates: Sequence[SchedulerHandle]) -> SchedulerHandle:
        t = time.perf_counter()
        h = candidates[next(self._n) % len(candidates)]
        self.record(Decision(h.address, "policy", 0, time.perf_counter() - t))
        return h


def least_loaded(candidates: Sequence[SchedulerHandle], rotate: int) -> SchedulerHandle:
    k = rotate % len(candidates)
    return min([*candidates[k:], *candidates[:k]], key=lambda h: h.busy)  # ties: rotating order


class LeastLoadRouter(_Recorder):
    name = "least-load"

    def __init__(self) -> None:
        super().__init__()
        self._n = itertools.count()

    def choose(self, input_ids: Sequence[int], candidates: Sequence[SchedulerHandle]) -> SchedulerHandle:
        t = time.perf_counter()
        h = least_loaded(candidates, next(self._n))
        self.record(Decision(h.address, "policy", 0, time.perf_counter() - t))
        return h


class RecentRoutes:
    """Where this router sent each block lately: hash -> (pod, expires at), bounded, with the number
    of live blocks per pod (a pod's share of the recently routed prefixes)."""

    def __init__(self, ttl_s: float, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self._where: OrderedDict[int, tuple[str, float]] = OrderedDict()  # oldest expiry first
        self._blocks: dict[str, int] = {}

    def remember(self, hashes: Sequence[int], pod: str, now: float) -> None:
        for h in hashes:
            old = self._where.pop(h, None)
            if old is not None:
                self._blocks[old[0]] -= 1
            self._where[h] = (pod, now + self.ttl_s)
            self._blocks[pod] = self._blocks.get(pod, 0) + 1
        while len(self._where) > self._max:
            self._forget_oldest()

    def match(self, hashes: Sequence[int], now: float) -> tuple[str | None, int]:
        pod, n = None, 0
        for h in hashes:
            got = self._where.get(h)
            if got is None or got[1] < now or (pod is not None and got[0] != pod):
                break
            pod, n = got[0], n + 1
        return pod, n

    def blocks(self, pod: str, now: float) -> int:
        """Blocks sent to ``pod`` within the last ``ttl_s`` (each counted once, on its latest pod)."""
        # One ttl for all: the dict is in expiry order, so the expired ones are at its front.
        while self._where and next(iter(self._where.values()))[1] < now:
            self._forget_oldest()
        return self._blocks.get(pod, 0)

    def _forget_oldest(self) -> None:
        _, (pod, _) = self._where.popitem(last=False)
        self._blocks[pod] -= 1


class CacheAwareRouter(_Recorder):
    name = "cache-aware"

    def __init__(
        self,
        index: PrefixIndex,
        model_name: str,
        block_size: int = DEFAULT_BLOCK_SIZE,
        balance_abs: int = ROUTING.balance_abs_threshold,
        balance_rel: float = ROUTING.balance_rel_threshold,
        recent_ttl_s: float = ROUTING.recent_ttl,
        retry_s: float = 1.0,
        working_set_s: float = ROUTING.working_set_window,
        kv_fill: float = ROUTING.kv_fill,
        tier_weights: TierWeights = _WEIGHTS,
    ) -> None:
        super().__init__()
        self.weights = tier_weights
        self.index = index
        self.model_name = model_name
        self.block_size = block_size
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.recent = RecentRoutes(recent_ttl_s)
        # Each pod's share of the prefixes in use: what this router sent it lately. New prefixes go
        # where it is smallest. (Pods' own KV figures cannot tell this: a warm cache is always full.)
        self.working_set = RecentRoutes(working_set_s)
        # A new prefix fits a pod while its working set stays under this share of the pod's KV
        # (the rest is for the running requests' own tokens).
        if kv_fill <= 0:
            raise ValueError(f"kv_fill must be > 0 (got {kv_fill})")
        self.kv_fill = kv_fill
        self.retry_s = retry_s
        self._index_down_until = 0.0
        self._n = itertools.count()

    def _new_prefix_rank(self, c: SchedulerHandle, tokens: int, now: float) -> tuple[bool, int, int, int]:
        """Sort key of the pods for a prompt that matches nowhere: smallest is best."""
        ws = self.working_set.blocks(c.address, now) * self.block_size
        capacity = c.load.kv_capacity_tokens if c.load is not None else 0
        # Room first: a prefix sent where the working set already fills the KV evicts another
        # tenant's prefix, which is computed again on its next request (docs/benchmarks.md, routing).
        fits = capacity == 0 or ws + tokens <= capacity * self.kv_fill
        # Then what the pod is doing now: ranked by working set first, prompts too short to leave one
        # (no blocks) would all go to one pod; with load second a pod's queue decides.
        return (not fits, c.busy, ws, c.footprint)

    def _matched(
        self, hashes: Sequence[int], candidates: Sequence[SchedulerHandle], now: float
    ) -> dict[str, TierMatch]:
        """Per pod, its leading blocks by tier: the index's, or what this router sent it lately (on its
        device by now, or soon), whichever is longer. Raises what the index raises."""
        locations = {
            c.address: c.load.disk_location for c in candidates if c.load is not None and c.load.disk_location
        }
        matched = self.index.match_tiers(hashes, locations) if hashes else {}
        pod, n = self.recent.match(hashes, now)
        if pod is not None and n > matched.get(pod, TierMatch()).blocks:
            matched[pod] = TierMatch(device=n)
        return matched

    def choose(self, input_ids: Sequence[int], candidates: Sequence[SchedulerHandle]) -> SchedulerHandle:
        t = time.perf_counter()
        now = time.monotonic()
        rotate = next(self._n)
        hashes = block_hashes(input_ids, self.model_name, self.block_size)
        matched: dict[str, TierMatch] = {}
        index_ok = now >= self._index_down_until
        if index_ok:
            try:
                matched = self._matched(hashes, candidates, now)
            except Exception as e:  # redis.RedisError, timeouts: degrade, retry later
                log.warning("prefix index unreachable (%s): least-load routing for %.1f s", e, self.retry_s)
                self._index_down_until = now + self.retry_s
                index_ok = False
        if not index_ok:
            h = least_loaded(candidates, rotate)
            self.record(Decision(h.address, "index-down", 0, time.perf_counter() - t))
            return h
        none = TierMatch()
        of = {c.address: matched.get(c.address, none) for c in candidates}
        score = {pod: self.weights.score(m) for pod, m in of.items()}
        best = max(score.values(), default=0.0)
        if best <= 0:
            # A new prefix: to the least busy pod among those with room for it; ties (equally idle
            # pods) to the smallest working set (SGLang sends it to the smallest tree), then the
            # least KV held, then in rotating order.
            k = rotate % len(candidates)
            rotated = [*candidates[k:], *candidates[:k]]
            h = min(rotated, key=lambda c: self._new_prefix_rank(c, len(input_ids), now))
            reason = "no-match"
        else:
            # equal scores are sums of the same weights: equal up to rounding
            h = least_loaded([c for c in candidates if score[c.address] >= best - 1e-9], rotate)
            reason = "prefix"
            # Out of balance is judged on the pod the prefix would go to, not on the spread of all
            # pods: diverting requests whose prefix lives on a calm pod would copy their prefixes
            # elsewhere and leave the overloaded pod as loaded as before.
            lo = min(c.busy for c in candidates)
            if h.busy - lo > self.balance_abs and h.busy > self.balance_rel * lo:
                h, reason = least_loaded(candidates, rotate), "balance"
        mine = of[h.address]
        # what the pod computes: a prefix on its lower tiers is loaded back, not computed
        h.routed_tokens += len(input_ids) - mine.blocks * self.block_size
        self.recent.remember(hashes, h.address, now)
        # The working set counts prefixes, not requests: a request that shares a prefix adds only
        # that prefix (its own tail blocks are never reused), or every request would grow its
        # pod's set by its unique tail and new prefixes would spread by request count instead.
        shared = max((m.blocks for m in of.values()), default=0)
        self.working_set.remember(hashes[:shared] if shared else hashes, h.address, now)
        seconds = time.perf_counter() - t
        self.record(Decision(h.address, reason, mine.blocks, seconds, mine, score[h.address]))
        return h


def make_router(routing: RoutingConfig, index: PrefixIndex, model_name: str) -> Router:
    """The gateway's routing policy (--router), over its prefix index."""
    if routing.router == "cache-aware":
        return CacheAwareRouter(
            index,
            model_name,
            routing.block_size,
            routing.balance_abs_threshold,
            routing.balance_rel_threshold,
            routing.recent_ttl,
            working_set_s=routing.working_set_window,
            kv_fill=routing.kv_fill,
            tier_weights=routing.tier_weights(),
        )
    if routing.router == "least-load":
        return LeastLoadRouter()
    if routing.router == "round-robin":
        return RoundRobinRouter()
    raise ValueError(f"unknown routing policy {routing.router!r}")
