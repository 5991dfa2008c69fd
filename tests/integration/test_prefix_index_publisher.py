"""The KV-event publisher that keeps a scheduler pod's prefix-index entries in Redis (block events,
heartbeats, healing after Redis restarts or sweeps) and the EventHub it reads them from, against a
real redis-server (tests/redis_server.py). The index itself is in test_prefix_index.py."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from radixserve.common.prefix_index import RedisPrefixIndex, open_index
from radixserve.common.rpc import pb
from radixserve.scheduler.kv_events import EventHub, EventSubscriber, RedisPublisher
from radixserve.tokenizer.routing.router import CacheAwareRouter
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle
from tests.helpers.prefix_index import BS, MODEL, hashes_of, prompt, tls_server_fixture, wait_until  # noqa: F401
from tests.redis_server import RedisServer, redis_server_fixture  # noqa: F401


def test_a_subscriber_that_falls_behind_gets_a_snapshot_instead() -> None:
    hub = EventHub()
    sub = hub.subscribe(EventSubscriber(max_pending=10))
    held = list(range(100, 130))
    hub.publish([], lambda: [("stored", held[:5])])  # the first thing a subscriber gets: the whole state
    assert sub.take(0) == (True, held[:5], [], [])
    hub.publish([("stored", held[5:8]), ("removed", held[:1])], lambda: [("stored", held)])
    assert sub.take(0) == (False, held[5:8], held[:1], [])
    hub.publish([("stored", held[8:30])], lambda: [("stored", held)])  # more than max_pending: dropped
    assert sub.need_snapshot and sub.take(0) is None
    hub.publish([], lambda: [("stored", held)])
    assert sub.take(0) == (True, held, [], [])
    assert sub.snapshots == 2


class FakeEngine:
    """The scheduler's engine thread, as far as block events go: a set of held block hashes that
    the test changes, and a loop that hands the changes to the EventHub every few milliseconds."""

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.held: set[int] = set()
        self._events: list[tuple[str, list[int]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.publish_s: list[float] = []  # how long each hub.publish took
        self._thread = threading.Thread(target=self._run, daemon=True)

    def store(self, hashes: list[int]) -> None:
        with self._lock:
            new = [h for h in hashes if h not in self.held]
            self.held.update(new)
            self._events.append(("stored", new))

    def evict(self, hashes: list[int]) -> None:
        with self._lock:
            gone = [h for h in hashes if h in self.held]
            self.held.difference_update(gone)
            self._events.append(("removed", gone))

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                events, self._events = self._events, []
                snapshot = sorted(self.held)
            t = time.perf_counter()
            self.hub.publish(events, lambda s=snapshot: [("stored", s)])  # type: ignore[misc]
            self.publish_s.append(time.perf_counter() - t)
            self._stop.wait(0.005)

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


LOAD = {"waiting": 2, "running": 3}


@pytest.fixture
def publishing(redis_server: RedisServer) -> Iterator[tuple[FakeEngine, RedisPublisher, RedisPrefixIndex]]:
    """A pod "pod-a" publishing to Redis, and a gateway's index reading it."""
    hub = EventHub()
    with FakeEngine(hub) as engine:
        engine.store(hashes_of(prompt(1, 4)))  # held before the publisher starts: the snapshot
        pub = RedisPublisher(
            RedisPrefixIndex(redis_server.url),
            "pod-a",
            hub.subscribe(EventSubscriber()),
            lambda: LOAD,
            heartbeat_s=0.05,
            ttl_s=1.0,
        )
        pub.start()
        try:
            yield engine, pub, RedisPrefixIndex(redis_server.url)
        finally:
            pub.close()


def test_publisher_writes_block_events_and_heartbeats(publishing: Any) -> None:
    engine, pub, index = publishing
    first, second = hashes_of(prompt(1, 4)), hashes_of(prompt(2, 6))
    wait_until(lambda: index.match(first) == {"pod-a": 4}, what="the snapshot")
    wait_until(lambda: index.live_pods() == {"pod-a": LOAD}, what="a heartbeat")
    engine.store(second)
    wait_until(lambda: index.match(second) == {"pod-a": 6}, what="stored blocks")
    engine.evict(second[3:])
    wait_until(lambda: index.match(second) == {"pod-a": 3}, what="removed blocks")
    assert index.num_blocks("pod-a") == 7
    pub.close()
    assert index.match(first) == {} and index.match(second) == {}
    assert index.live_pods() == {} and index.num_blocks("pod-a") == 0


def test_publisher_survives_redis_going_away_and_heals_when_it_restarts_empty(
    publishing: Any, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    engine, pub, index = publishing
    caplog.set_level(logging.INFO, logger="radixserve.scheduler.kv_events")
    first, second, third = hashes_of(prompt(1, 4)), hashes_of(prompt(2, 5)), hashes_of(prompt(3, 3))
    engine.store(second)
    wait_until(lambda: index.match(second) == {"pod-a": 5}, what="publishing")

    redis_server.stop()
    wait_until(lambda: not pub.connected, what="the publisher noticing the outage")
    engine.publish_s.clear()
    engine.store(third)  # the engine goes on while Redis is down
    engine.evict(second[2:])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        engine.store(hashes_of(prompt(random.randrange(10, 10_000), 2)))
        time.sleep(0.01)
    assert len(engine.publish_s) > 20  # the engine thread kept stepping
    assert max(engine.publish_s) < 0.05, max(engine.publish_s)  # hub.publish never waits on Redis
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "unreachable" in r.message]
    assert len(warnings) == 1, [r.message for r in caplog.records]  # once per outage

    redis_server.start()  # on the same port, EMPTY
    healed = wait_until(
        lambda: (
            index.match(first) == {"pod-a": 4}
            and index.match(second) == {"pod-a": 2}
            and index.match(third) == {"pod-a": 3}
        ),
        timeout_s=5.0,
        what="the publisher republishing its snapshot",
    )
    assert index.live_pods() == {"pod-a": LOAD}
    assert index.num_blocks("pod-a") == len(engine.held)
    assert pub.connected
    print(f"\nindex healed {healed:.2f} s after Redis came back")


def test_publisher_republishes_after_redis_is_flushed_without_any_failed_call(
    publishing: Any, redis_server: RedisServer
) -> None:
    """A restart between two calls looks like this to the publisher: every call succeeds (the
    client reconnects), but its heartbeat and blocks are gone."""
    _engine, pub, index = publishing
    first = hashes_of(prompt(1, 4))
    wait_until(lambda: index.match(first) == {"pod-a": 4}, what="publishing")
    failures = pub.failures
    redis_server.client().flushall()
    assert index.match(first) == {}
    wait_until(lambda: index.match(first) == {"pod-a": 4}, what="republishing after FLUSHALL")
    assert pub.failures == failures


def test_publisher_republishes_after_a_gateway_swept_the_pod(publishing: Any) -> None:
    """A pod that stalled past its TTL is swept by a gateway; when it beats again, it republishes."""
    _engine, _pub, index = publishing
    first = hashes_of(prompt(1, 4))
    wait_until(lambda: index.match(first) == {"pod-a": 4}, what="publishing")
    index.remove_pod("pod-a")  # what sweep() does to a pod whose heartbeat lapsed
    wait_until(lambda: index.match(first) == {"pod-a": 4}, what="republishing after a sweep")
    assert index.live_pods() == {"pod-a": LOAD}


class SweptAfterItsFirstWrite(RedisPrefixIndex):
    """A pod's index whose first block write is followed at once by a gateway's sweep (a gateway
    sweeps every pod without a live heartbeat, at any moment)."""

    swept: list[str] | None = None

    def apply(self, pod: str, *args: Any, **kwargs: Any) -> None:
        super().apply(pod, *args, **kwargs)
        if self.swept is None:
            self.swept = self.sweep()


def test_a_sweep_right_after_a_new_pods_first_write_never_leaves_its_blocks_out(
    redis_server: RedisServer,
) -> None:
    """The race CI met: a pod wrote its blocks, then a sweep ran before its first heartbeat, which
    (being its first) could not tell that anything was lost. A pod beats before it writes."""
    hub = EventHub()
    index = SweptAfterItsFirstWrite(redis_server.url)
    with FakeEngine(hub) as engine:
        engine.store(hashes_of(prompt(1, 4)))
        pub = RedisPublisher(
            index, "pod-a", hub.subscribe(EventSubscriber()), lambda: LOAD, heartbeat_s=0.05, ttl_s=1.0
        )
        pub.start()
        try:
            reader = RedisPrefixIndex(redis_server.url)
            wait_until(lambda: reader.match(hashes_of(prompt(1, 4))) == {"pod-a": 4}, what="the pod's blocks")
            assert index.swept == []  # the pod was live when the sweep ran
            assert reader.live_pods() == {"pod-a": LOAD}
        finally:
            pub.close()


def test_over_tls_a_pods_publisher_feeds_a_gateways_router_and_heals_after_a_restart(
    tls_server: RedisServer,
) -> None:
    """The scheduler's side (RedisPublisher on RedisPrefixIndex(url)) and the gateway's
    (open_index(url) under CacheAwareRouter), both given the same rediss:// URL."""
    url = tls_server.url  # rediss://:s3cret@127.0.0.1:PORT/0?ssl_ca_certs=/tmp/.../ca.pem
    assert url.startswith("rediss://:s3cret@") and "ssl_ca_certs=" in url
    hub = EventHub()
    ids = prompt(1, 4) + [7, 8, 9]
    a, b = (SchedulerHandle(p, healthy=True, load=pb.Load()) for p in ("pod-a", "pod-b"))
    router = CacheAwareRouter(open_index(url), MODEL, BS, recent_ttl_s=0)

    def routed() -> tuple[str, str, int]:
        router.choose(ids, [b, a])
        d = router.decisions[-1]
        return d.pod, d.reason, d.matched_blocks

    with FakeEngine(hub) as engine:
        engine.store(hashes_of(prompt(1, 4)))
        pub = RedisPublisher(
            RedisPrefixIndex(url), "pod-a", hub.subscribe(EventSubscriber()), lambda: LOAD, 0.05, 1.0
        )
        pub.start()
        try:
            wait_until(lambda: routed() == ("pod-a", "prefix", 4), what="routing on the published prefix")
            engine.evict(hashes_of(prompt(1, 4))[2:])
            wait_until(lambda: routed() == ("pod-a", "prefix", 2), what="removed blocks")
            tls_server.restart()  # empty; the publisher reconnects over TLS and republishes
            wait_until(lambda: routed() == ("pod-a", "prefix", 2), what="republishing after a restart")
            # the heartbeat is republished on its own schedule, beside the blocks
            wait_until(
                lambda: router.index.live_pods() == {"pod-a": LOAD}, what="the heartbeat after a restart"
            )
        finally:
            pub.close()
    assert routed()[1] == "no-match"  # a closing pod removes its entries
