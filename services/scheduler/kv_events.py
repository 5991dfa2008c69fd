"""Block events leave the engine here, off its critical path.

The engine thread, once per step, hands the radix cache's block events to every
``EventSubscriber`` (a Watch stream of a gateway, the Redis publisher). A subscriber's backlog is
bounded: one that falls behind (or whose sink failed) drops its backlog and asks for a snapshot,
which the engine thread provides at its next step (``cleared`` + every block it holds), so every
index heals itself. Consumers take the net effect of everything pending in one go: per block, the
best tier the pod holds it on now (common/kv_tier.py), or removed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from radixserve.common.kv_tier import DEVICE, STORED_EVENTS

if TYPE_CHECKING:
    from radixserve.common.prefix_index import RedisPrefixIndex

log = logging.getLogger(__name__)


_REMOVED = -1


class BlockDelta(NamedTuple):
    """The net effect of a pod's block events since the last take."""

    cleared: bool  # everything the pod held before is gone (then ``stored`` is what it holds)
    stored: list[int]
    removed: list[int]
    tiers: list[int]  # along ``stored``: the tier each is on now (common/kv_tier.py)


Events = list[tuple[str, list[int]]]  # (kind, hashes), as the radix cache records them


class EventSubscriber:
    def __init__(self, max_pending: int = 200_000) -> None:
        self._cond = threading.Condition()
        self._net: dict[int, int] = {}  # hash -> its tier now, or _REMOVED: the net effect
        self._cleared = False
        self._max = max_pending
        self.need_snapshot = True  # the first thing a subscriber gets is the whole state
        self.snapshots = 0
        self.pending_since: float | None = None  # when the oldest event not yet taken came in

    # engine thread
    def push(self, events: Events) -> None:
        with self._cond:
            if self.need_snapshot:
                return  # a snapshot will cover these
            for kind, hashes in events:
                if kind == "cleared":
                    self._net.clear()
                    self._cleared = True
                    continue
                tier = _REMOVED if kind == "removed" else STORED_EVENTS[kind]  # else a bug: raise
                for h in hashes:
                    self._net[h] = tier
            if self.pending_since is None and self._net:
                self.pending_since = time.monotonic()
            if len(self._net) > self._max:  # fallen behind: resynchronise instead of growing
                self.request_snapshot()
            self._cond.notify()

    def snapshot(self, held: Events) -> None:
        """Everything the pod holds: the events that store each block at its tier."""
        with self._cond:
            self._net = {h: STORED_EVENTS[kind] for kind, hashes in held for h in hashes}
            self._cleared = True
            self.need_snapshot = False
            self.snapshots += 1
            self._cond.notify()

    # any thread
    def request_snapshot(self) -> None:
        with self._cond:
            self._net.clear()
            self._cleared = False
            self.need_snapshot = True

    # consumer
    def take(self, timeout: float) -> BlockDelta | None:
        """What is pending since the last take, or None if nothing came in time."""
        with self._cond:
            if not self._net and not self._cleared:
                self._cond.wait(timeout)
            if self.need_snapshot or (not self._net and not self._cleared):
                return None
            net, cleared = self._net, self._cleared
            self._net, self._cleared = {}, False
            self.pending_since = None
        stored = [(h, t) for h, t in net.items() if t != _REMOVED]
        removed = [h for h, t in net.items() if t == _REMOVED]
        tiers = [t for _, t in stored] if any(t != DEVICE for _, t in stored) else []  # none: all device
        return BlockDelta(cleared, [h for h, _ in stored], removed, tiers)


class EventHub:
    """The engine's side: subscribers come and go from other threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: list[EventSubscriber] = []

    def subscribe(self, sub: EventSubscriber) -> EventSubscriber:
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: EventSubscriber) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def publish(self, events: Events, snapshot_of: Callable[[], Events]) -> None:
        """Engine thread, once per step. ``snapshot_of``: the cache's snapshot (for those that need one)."""
        with self._lock:
            subs = list(self._subs)
        snapshot: Events | None = None
        for sub in subs:
            if sub.need_snapshot:
                if snapshot is None:
                    snapshot = snapshot_of()
                sub.snapshot(snapshot)
            elif events:
                sub.push(events)


class RedisPublisher:
    """Writes one pod's block events and heartbeats to a RedisPrefixIndex from its own thread.

    Redis being slow or down never blocks the engine: events wait in the subscriber (bounded),
    failures are logged once per outage, and on reconnect the pod clears its old entries and
    republishes everything it holds. It does the same when a heartbeat finds its previous one gone
    although no call failed (Redis restarted or flushed between two calls, or a gateway swept the
    pod after it stalled past the TTL): the index heals either way.
    """

    def __init__(
        self,
        index: RedisPrefixIndex,
        pod: str,
        sub: EventSubscriber,
        load: Callable[[], dict[str, object]],
        heartbeat_s: float = 1.0,
        ttl_s: float = 5.0,
        location: str = "",
    ) -> None:
        """``location``: the id of the shared disk directory whose blocks this pod reports as on disk
        ("": none, or a disk of its own): they are published under it (common/kv_tier.py)."""
        from radixserve.common.prefix_index import check_pod

        if not (heartbeat_s > 0 and ttl_s > heartbeat_s):
            raise ValueError(
                f"heartbeat every {heartbeat_s} s with a TTL of {ttl_s} s: expected 0 < every < TTL"
            )
        self.index, self.pod, self.sub, self.load = index, check_pod(pod), sub, load
        self.heartbeat_s, self.ttl_s = heartbeat_s, ttl_s
        self.location = location
        self.connected = False
        self.failures = 0
        self.published = 0  # block events written
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            got = self.sub.take(timeout=min(0.05, self.heartbeat_s))
            try:
                now = time.monotonic()
                # The beat goes before the blocks: a gateway sweeps every pod without a live
                # heartbeat, and a sweep between a pod's first write and its first beat would drop
                # blocks that beat (the first: nothing to compare with) could not tell were lost.
                if now >= next_beat:
                    was_live = self.index.heartbeat(self.pod, self._load(), self.ttl_s)
                    next_beat = now + self.heartbeat_s
                    if self.connected and was_live is False:
                        # Our heartbeat was gone though every call succeeded: Redis restarted or
                        # was flushed between two calls (the client reconnects silently), or we
                        # stalled past the TTL and a gateway swept our blocks. Republish them.
                        log.warning("prefix index lost this pod's entries; republishing them")
                        self.sub.request_snapshot()
                if got is not None:
                    self.index.apply(self.pod, got.stored, got.removed, got.cleared, got.tiers, self.location)
                    self.published += len(got.stored) + len(got.removed)
                if not self.connected:
                    log.info("prefix index %s: publishing", getattr(self.index, "url", self.index))
                    self.connected = True
            except Exception as e:  # redis.RedisError and OS errors alike: degrade, never stall
                self.failures += 1
                if (self.connected or self.failures == 1) and _refused(e):
                    log.error(
                        "prefix index %s refuses this pod (%s): check its key prefix (%r) and Redis user;"
                        " will retry",
                        getattr(self.index, "url", self.index),
                        e,
                        getattr(self.index, "key_prefix", None),
                    )
                elif self.connected or self.failures == 1:
                    log.warning("prefix index unreachable (%s); will resync when it is back", e)
                self.connected = False
                self.sub.request_snapshot()  # what it had may be stale or gone (a restarted Redis)
                next_beat = 0.0  # back, it beats before it writes again
                self._stop.wait(0.5)

    def _load(self) -> dict[str, object]:
        """The pod's load; a heartbeat goes out even when that fails (liveness first)."""
        try:
            return self.load()
        except Exception:
            log.exception("reading this pod's load failed; heartbeat sent without it")
            return {}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with contextlib.suppress(Exception):  # leave no entries behind for routers to chase
            self.index.remove_pod(self.pod)


def _refused(e: Exception) -> bool:
    """Whether Redis refused us (wrong password or user, or a key or command the user may not use)
    rather than being unreachable: a setting to fix, not an outage to wait out."""
    try:
        from redis.exceptions import AuthenticationError, NoPermissionError
    except ImportError:
        return False
    return isinstance(e, (AuthenticationError, NoPermissionError))
