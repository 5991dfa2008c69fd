"""Scheduler pods as the gateway sees them: one ``SchedulerHandle`` per pod, kept fresh by the pool.

``SchedulerPool`` keeps a channel and a Watch stream open to every scheduler: each update
refreshes the pod's load (and, with the in-memory prefix index, applies its KV block events);
a broken stream marks the pod down at once (its waiting clients get an error, see
PoolListener.scheduler_down, and its index entries go) until the stream reopens. A pod that sends
nothing for ``stale_s`` is down too. The routing policies (router.py) choose among the handles.

A pod whose load says ``draining`` (it got SIGTERM: it refuses new work and finishes what it has)
is never routed to, and the listener's ``scheduler_draining`` hears of it once, so the gateway can
move what has not started streaming yet.

Discovery (``--schedulers discover``): the pool starts empty and ``discovered`` (called by the
gateway's Redis sweep, about every second, with the pods whose heartbeat is live) adds a handle
for each new address and removes those whose heartbeat expired AND whose Watch stream is down
(a draining pod keeps its stream, so it stays until it has finished; its outstanding requests, if
any are left, go through ``scheduler_down`` as for any pod that goes down).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from radixserve.common.prefix_index import InMemoryPrefixIndex
from radixserve.common.rpc import aio_channel, pb, pb_grpc
from radixserve.common.service_config import GATEWAY_DEFAULTS
from radixserve.common.tls import TLS

log = logging.getLogger(__name__)

DISCOVER = "discover"  # --schedulers discover: the pods come from the Redis index's heartbeats


class PoolListener(Protocol):
    """What the pool tells its owner (the gateway) of the pods, each when it happens."""

    def scheduler_up(self, h: SchedulerHandle) -> None:
        """``h``'s Watch stream (re)opened: it may be routed to again."""

    def scheduler_down(self, h: SchedulerHandle, why: str) -> None:
        """``h`` went away (stream broke, nothing sent for stale_s, heartbeat expired): what it holds
        must be moved or failed, not left waiting."""

    def scheduler_draining(self, h: SchedulerHandle) -> None:
        """``h`` said it drains (once): it admits nothing new."""


class _Refused(Exception):
    """A pod's Watch update that this gateway must not use (it serves another model)."""


@dataclass(eq=False)
class SchedulerHandle:
    address: str
    channel: grpc.aio.Channel | None = None
    rpc: pb_grpc.SchedulerStub | None = None  # set when the pool starts
    healthy: bool = False
    load: pb.Load | None = None  # the last report
    outstanding: set[str] = field(default_factory=set)  # rids this gateway sent here, not ended
    pending_aborts: dict[str, str] = field(default_factory=dict)  # rid -> reason, for when it is back
    sent: int = 0  # requests this gateway sent here since the pod's last load report
    routed_tokens: int = 0  # uncached prompt tokens this gateway sent here since the last load report
    refused: str | None = None  # why its Watch updates are not used (another model...), as last logged
    watcher: asyncio.Task[None] | None = None  # its Watch loop, while the pool has it

    @property
    def draining(self) -> bool:
        """Its last report said it drains (SIGTERM): it admits nothing new, finishes what it has."""
        return self.load is not None and self.load.draining

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        """The pod's Scheduler service (the pool has started: every handle has one)."""
        assert self.rpc is not None, f"scheduler {self.address}: the pool has not started"
        return self.rpc

    @property
    def busy(self) -> int:
        """Requests on the pod now: what it reported plus what this gateway sent since (a report
        lags by up to one interval, and a burst arrives within one), or what this gateway alone
        has there if that is more."""
        reported = self.load.waiting + self.load.running if self.load is not None else 0
        return max(reported + self.sent, len(self.outstanding))

    def reported(self, load: pb.Load) -> None:
        """A load report arrived: it counts what was sent before it."""
        self.load, self.sent, self.routed_tokens = load, 0, 0

    @property
    def footprint(self) -> int:
        """KV tokens the pod holds (requests + prefix cache), plus what was sent since it last said."""
        held = self.load.kv_used_tokens + self.load.kv_cached_tokens if self.load is not None else 0
        return held + self.routed_tokens


class SchedulerPool:
    """``memory_index``: an InMemoryPrefixIndex to feed from the pods' Watch streams (None when the
    index lives in Redis: the pods publish there themselves). ``stale_s``: a pod whose stream sends
    nothing for this long (stopped, wedged, a network that drops packets without closing the
    connection) is down like one whose stream broke."""

    def __init__(
        self,
        addresses: Sequence[str],
        listener: PoolListener,
        watch_interval_s: float = 0.2,
        memory_index: InMemoryPrefixIndex | None = None,
        stale_s: float = GATEWAY_DEFAULTS.scheduler_stale_after,
        tls: TLS | None = None,
        model_name: str | None = None,
        block_size: int | None = None,
    ) -> None:
        """``model_name`` / ``block_size``: what this gateway serves and hashes with; a pod whose
        Watch updates name another model is refused (down, never routed to), one that hashes with
        another block size is routed to but its block events stay out of the index (its hashes could
        never match this gateway's). None: not checked. ``addresses``: the static list (empty when
        the pods are ``discovered``)."""
        self.model_name = model_name
        self.block_size = block_size
        self.handles = [SchedulerHandle(a) for a in addresses]
        self.listener = listener
        self._interval = watch_interval_s
        self.stale_s = max(stale_s, 5 * watch_interval_s)
        self.memory_index = memory_index
        self._started = False
        self.tls = tls  # the channels': TLS, or None for plaintext

    def start(self) -> None:
        self._started = True
        for h in self.handles:
            self._open(h)

    def _open(self, h: SchedulerHandle) -> None:
        h.channel = aio_channel(h.address, self.tls)
        h.rpc = stub = pb_grpc.SchedulerStub(h.channel)
        h.watcher = asyncio.create_task(self._watch(h, stub))

    async def _close(self, h: SchedulerHandle) -> None:
        if h.watcher is not None:
            h.watcher.cancel()
            await asyncio.gather(h.watcher, return_exceptions=True)
        if h.channel is not None:
            await h.channel.close()

    async def discovered(self, live: Collection[str]) -> None:
        """Discovery: ``live`` are the pods whose heartbeat is live now. New ones get a handle (a
        channel and a Watch stream; routed to once it reports); one that is gone from ``live`` and
        whose Watch stream is down too is dropped, its outstanding requests through ``on_down``.
        A pod gone from ``live`` whose stream is up stays: it may be draining (a pod takes its
        heartbeat away at SIGTERM) or only cut off from Redis; its stream tells."""
        known = {h.address for h in self.handles}
        for address in sorted(set(live) - known):
            log.info("scheduler %s discovered (its heartbeat is live)", address)
            h = SchedulerHandle(address)
            self.handles.append(h)
            if self._started:
                self._open(h)
        for h in [h for h in self.handles if h.address not in live and not h.healthy]:
            log.info("scheduler %s forgotten (its heartbeat expired and its Watch stream is down)", h.address)
            self.handles.remove(h)
            await self._close(h)
            if h.outstanding:
                self.listener.scheduler_down(h, "its heartbeat expired and its Watch stream is down")

    def healthy(self) -> list[SchedulerHandle]:
        """The pods to route to: reporting, not draining."""
        return [h for h in self.handles if h.healthy and not h.draining]

    def unreachable(self, h: SchedulerHandle, why: str) -> None:
        """A call to the pod failed as if it were gone: no routing decision picks it until its Watch
        stream says otherwise (the stream, not this, decides about the requests it holds: a pod
        that refuses new work while it drains still finishes what it has)."""
        if h.healthy:
            log.warning("scheduler %s is unreachable (%s)", h.address, why)
            h.healthy = False

    async def _watch(self, h: SchedulerHandle, stub: pb_grpc.SchedulerStub) -> None:
        backoff = 0.05
        index = self.memory_index
        request = pb.WatchRequest(interval_s=self._interval, kv_events=index is not None)
        while True:
            call = stub.Watch(request, wait_for_ready=True)
            try:
                while True:
                    # Waiting for a pod to come up has no limit; a pod that was up and goes quiet
                    # is as good as gone, so its clients do not wait on it.
                    update = await asyncio.wait_for(call.read(), self.stale_s if h.healthy else None)
                    if update is grpc.aio.EOF:
                        break
                    mine = self._check_update(h, update)
                    came_up, was_draining = not h.healthy, h.draining
                    h.reported(update.load)
                    h.healthy = True
                    if came_up:
                        log.info("scheduler %s is up", h.address)
                        self.listener.scheduler_up(h)
                    if h.draining and not was_draining:
                        log.info("scheduler %s is draining: no new requests go there", h.address)
                        self.listener.scheduler_draining(h)
                    if index is not None and mine:
                        index.apply(
                            h.address,
                            update.stored,
                            update.removed,
                            update.cleared,
                            update.tiers,
                            update.load.disk_location,
                        )
                        index.heartbeat(h.address, {}, 10 * self._interval + 1)
                    backoff = 0.05
                why = "ended its watch stream"
            except asyncio.CancelledError:
                call.cancel()
                raise
            except (TimeoutError, asyncio.TimeoutError):  # two classes before Python 3.11
                why = f"sent nothing for {self.stale_s:.1f} s"
            except grpc.aio.AioRpcError as e:
                why = f"{e.code().name}: {e.details()}"
            except _Refused as e:
                why = str(e)
            except Exception as e:  # a bug here must not end the watch: the pod would never be down
                log.exception("watching scheduler %s failed", h.address)
                why = f"{type(e).__name__}: {e}"
            call.cancel()
            if h.healthy:
                log.warning("scheduler %s is down (%s)", h.address, why)
                h.healthy = False
            if index is not None:
                index.remove_pod(h.address)
            if h.outstanding:
                self.listener.scheduler_down(h, why)
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    def _check_update(self, h: SchedulerHandle, update: pb.PodUpdate) -> bool:
        """Whether ``update``'s block events belong in this gateway's index; raises _Refused for a
        pod that serves another model (logged once per reason). Unset fields (""/0): not checked."""
        why, refuse = None, False
        if self.model_name is not None and update.model_name and update.model_name != self.model_name:
            why, refuse = f"serves model {update.model_name[:100]!r}, not {self.model_name!r}", True
        elif self.block_size is not None and update.block_size and update.block_size != self.block_size:
            why = f"hashes blocks of {update.block_size} tokens, not {self.block_size}"
        if why != h.refused:
            if why is not None:
                then = "refused" if refuse else "routed to, its block events not indexed"
                log.error("scheduler %s %s: %s", h.address, why, then)
            h.refused = why
        if refuse:
            raise _Refused(f"{why} (refused)")
        return why is None

    async def close(self) -> None:
        await asyncio.gather(*(self._close(h) for h in self.handles))


def discovers(schedulers: Sequence[str], redis_index: bool) -> bool:
    """Whether ``--schedulers`` asks for discovery; raises ValueError naming the setting when it
    cannot work (discovery reads the pods' heartbeats, which only a Redis index has)."""
    if DISCOVER not in schedulers:
        return False
    if len(schedulers) > 1:
        raise ValueError(f"--schedulers {' '.join(schedulers)}: {DISCOVER!r} takes no addresses beside it")
    if not redis_index:
        raise ValueError(
            f"--schedulers {DISCOVER} reads the schedulers' heartbeats from the Redis prefix index:"
            " --prefix-index must be a redis:// or rediss:// URL (the in-memory index has no heartbeats)"
        )
    return True
