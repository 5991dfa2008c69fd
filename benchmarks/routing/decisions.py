"""Routing-decision latency: the run's requests replayed through a fresh router in-process, each
``choose`` timed (the gateway does not expose its decisions' timing)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import _common as common

from .monitor import PodMonitor
from .settings import BLOCK_SIZE


def time_decisions(
    policy: str,
    index: Any,
    addresses: Sequence[str],
    monitor: PodMonitor,
    reqs: list[dict],
    passes: int,
) -> dict:
    """``choose`` of a fresh router per pass, timed per call (see the package docstring)."""
    import gc

    from radixserve.common.rpc import pb
    from radixserve.tokenizer.routing.router import (
        CacheAwareRouter,
        LeastLoadRouter,
        RoundRobinRouter,
    )
    from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle

    handles = [SchedulerHandle(a, healthy=True) for a in addresses]
    loads = [[monitor.load_at(a, r["arrival"]) or pb.Load(address=a) for a in addresses] for r in reqs]
    times: list[float] = []
    inner: list[float] = []
    reasons: dict[str, int] = {}
    if index is not None and reqs:  # a warm connection (and loaded script), as a serving gateway has
        from radixserve.common.block_hash import block_hashes

        index.match(block_hashes(reqs[0]["input_ids"], common.MODEL_NAME, BLOCK_SIZE))
    gc.collect()
    for _ in range(passes):
        if policy == "cache-aware":
            router: Any = CacheAwareRouter(index, common.MODEL_NAME, BLOCK_SIZE)
        elif policy == "least-load":
            router = LeastLoadRouter()
        else:
            router = RoundRobinRouter()
        for r, ld in zip(reqs, loads, strict=True):
            for h, lo in zip(handles, ld, strict=True):
                h.load = lo
            ids = r["input_ids"]
            t = time.perf_counter()
            router.choose(ids, handles)
            times.append(time.perf_counter() - t)
        for d in router.decisions:
            inner.append(d.seconds)
            reasons[d.reason] = reasons.get(d.reason, 0) + 1
    ms = 1e3
    return {
        "decisions": len(times),
        **common.ms_percentiles("decision", times),
        "decision_ms_max": ms * max(times),
        "decision_ms_mean": ms * sum(times) / len(times),
        **common.ms_percentiles("router_recorded", inner, (99,)),
        "replay_reasons": reasons,
        "index": type(index).__name__ if index is not None else None,
    }


def replay_decisions(
    policy: str,
    redis_url: str | None,
    monitor: PodMonitor,
    addresses: Sequence[str],
    reqs: list[dict],
    passes: int,
) -> dict:
    """``time_decisions`` on the index the configuration's gateway used, after its traffic."""
    from radixserve.common.prefix_index import RedisPrefixIndex

    index: Any = None
    if policy == "cache-aware":
        # +redis: the pods' live published state; memory: what the gateway's index was fed
        index = RedisPrefixIndex(redis_url) if redis_url is not None else monitor.index
    try:
        return time_decisions(policy, index, addresses, monitor, reqs, passes)
    finally:
        if isinstance(index, RedisPrefixIndex):
            index.redis.close()
