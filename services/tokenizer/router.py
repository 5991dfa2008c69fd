"""Scheduler pods as the gateway sees them, and the policy that picks one per request.

``SchedulerPool`` keeps a channel and a WatchLoad stream open to every scheduler: each Load
message refreshes the pod's load, and a broken stream marks the pod down at once (its waiting
clients get an error; see Gateway.scheduler_down) until the stream reopens.

Routers are behind one small interface (``Router.choose``) so the prefix-index router can
replace them without touching the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from radixserve.common.rpc import CHANNEL_OPTIONS, pb, pb_grpc

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SchedulerHandle:
    address: str
    channel: Any = None
    stub: Any = None
    healthy: bool = False
    load: Any = None  # the last pb.Load
    outstanding: set[str] = field(default_factory=set)  # rids this gateway sent here, not ended


class Router(Protocol):
    def choose(self, input_ids: Sequence[int], candidates: Sequence[SchedulerHandle]) -> SchedulerHandle: ...


class RoundRobinRouter:
    def __init__(self) -> None:
        self._n = itertools.count()

    def choose(self, input_ids: Sequence[int], candidates: Sequence[SchedulerHandle]) -> SchedulerHandle:
        return candidates[next(self._n) % len(candidates)]


class LeastLoadRouter:
    """Fewest requests outstanding from this gateway (exact and current, unlike the pod's load
    report, which is up to one report interval old); ties go round-robin."""

    def __init__(self) -> None:
        self._n = itertools.count()

    def choose(self, input_ids: Sequence[int], candidates: Sequence[SchedulerHandle]) -> SchedulerHandle:
        k = next(self._n) % len(candidates)
        order = [*candidates[k:], *candidates[:k]]
        return min(order, key=lambda h: len(h.outstanding))


ROUTERS: dict[str, Callable[[], Router]] = {"least-load": LeastLoadRouter, "round-robin": RoundRobinRouter}


class SchedulerPool:
    def __init__(
        self,
        addresses: Sequence[str],
        on_down: Callable[[SchedulerHandle, str], None],
        watch_interval_s: float = 0.2,
    ) -> None:
        self.handles = [SchedulerHandle(a) for a in addresses]
        self._on_down = on_down
        self._interval = watch_interval_s
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for h in self.handles:
            h.channel = grpc.aio.insecure_channel(h.address, options=CHANNEL_OPTIONS)
            h.stub = pb_grpc.SchedulerStub(h.channel)
            self._tasks.append(asyncio.create_task(self._watch(h)))

    def healthy(self) -> list[SchedulerHandle]:
        return [h for h in self.handles if h.healthy and not (h.load and h.load.draining)]

    async def _watch(self, h: SchedulerHandle) -> None:
        backoff = 0.05
        while True:
            try:
                call = h.stub.WatchLoad(pb.WatchLoadRequest(interval_s=self._interval), wait_for_ready=True)
                async for load in call:
                    if not h.healthy:
                        log.info("scheduler %s is up", h.address)
                    h.load, h.healthy = load, True
                    backoff = 0.05
                why = "ended its load stream"
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                why = f"{e.code().name}: {e.details()}"
            if h.healthy:
                log.warning("scheduler %s is down (%s)", h.address, why)
                h.healthy = False
            if h.outstanding:
                self._on_down(h, why)
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for h in self.handles:
            if h.channel is not None:
                await h.channel.close()
