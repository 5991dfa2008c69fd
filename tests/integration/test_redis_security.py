"""The prefix index's Redis, shared by several InferenceServices: each service's own key prefix and
ACL user (``acl_rules``), liveness that survives eviction (``maxmemory-policy volatile-lru``), and
TLS with an ACL user, against a real redis-server (tests/redis_server.py). No model, no cluster:
RedisPrefixIndex and the scheduler's RedisPublisher, as the services use them."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from radixserve.common.prefix_index import RedisPrefixIndex, acl_rules, open_index
from radixserve.scheduler.kv_events import EventHub, EventSubscriber, RedisPublisher
from tests.helpers.prefix_index import hashes_of, prompt, wait_until
from tests.redis_server import RedisServer

A, B = "rs:default/alpha:", "rs:team-b/beta:"  # what the operator gives two InferenceServices
POLICY = "volatile-lru"  # what the chart's Redis runs with


def two_services(s: RedisServer) -> tuple[str, str]:
    """ACL users "alpha" and "beta", each limited to its service's prefix; their URLs."""
    s.add_user("alpha", "pw-alpha", acl_rules(A))
    s.add_user("beta", "pw-beta", acl_rules(B))
    return s.url_for("alpha", "pw-alpha"), s.url_for("beta", "pw-beta")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(password="admin") as s:
        yield s


def _refusals(s: RedisServer, user: str) -> list[tuple[Any, Any]]:
    return [(e["reason"], e["object"]) for e in s.acl_log() if e["username"] == user]


def test_each_service_uses_its_own_keys_with_its_own_user_and_nothing_else(server: RedisServer) -> None:
    s = server
    url_a, url_b = two_services(s)
    writer, reader = RedisPrefixIndex(url_a, A), open_index(url_a, A)  # a scheduler's, a gateway's
    other = RedisPrefixIndex(url_b, B)
    h = hashes_of(prompt(1, 6))

    # A's index, end to end, as A's user
    writer.apply("a-0.alpha:50051", h, [])
    writer.apply("a-1.alpha:50051", h[:2], [])
    writer.apply("ghost.alpha:50051", h[:1], [])  # blocks, never a heartbeat
    assert writer.heartbeat("a-0.alpha:50051", {"waiting": 1}, 60) is False
    assert writer.heartbeat("a-0.alpha:50051", {"waiting": 2}, 60) is True
    assert writer.heartbeat("a-1.alpha:50051", {"waiting": 0}, 0.2) is False
    other.apply("b-0.beta:50051", h, [])
    other.heartbeat("b-0.beta:50051", {"waiting": 9}, 60)
    assert reader.match(h) == {"a-0.alpha:50051": 6, "a-1.alpha:50051": 2, "ghost.alpha:50051": 1}
    writer.apply("a-0.alpha:50051", h[:4], [], cleared=True)
    writer.apply("a-0.alpha:50051", [], h[3:])
    time.sleep(0.3)  # a-1's heartbeat lapses
    assert reader.live_pods() == {"a-0.alpha:50051": {"waiting": 2}}
    assert reader.sweep() == ["a-1.alpha:50051", "ghost.alpha:50051"]
    assert reader.match(h) == {"a-0.alpha:50051": 3} and reader.num_blocks("a-0.alpha:50051") == 3
    assert other.match(h) == {"b-0.beta:50051": 6}  # B's index is its own
    assert other.live_pods() == {"b-0.beta:50051": {"waiting": 9}}
    s.client().script_flush()  # what a restart does to the scripts: redis-py loads them again
    assert reader.match(h) == {"a-0.alpha:50051": 3}
    db1 = RedisPrefixIndex(url_a.replace("/0", "/1"), A)  # another database: SELECT
    db1.heartbeat("a-0.alpha:50051", {}, 60)
    assert list(db1.live_pods()) == ["a-0.alpha:50051"]
    # REDIS_COMMANDS held everything the index sent (redis-py's connect included)
    assert _refusals(s, "alpha") == [] and _refusals(s, "beta") == []
    assert all(k.startswith((A, B)) for k in s.client().keys("*"))

    # A's credentials on B's keys: refused, reading or writing
    raw = redis.Redis.from_url(url_a, decode_responses=True)
    b_hb = f"{B}p:b-0.beta:50051:hb"
    forged = '99999999999999 {"waiting": 0}'
    refused = [
        lambda: raw.get(b_hb),  # B's load
        lambda: raw.mget([b_hb]),
        lambda: raw.smembers(f"{B}pods"),
        lambda: raw.set(b_hb, forged),  # a forged heartbeat
        lambda: raw.set(f"{B}p:evil:hb", forged),
        lambda: raw.hset(f"{B}k:{h[0]}", "evil:1", 0),  # a forged KV event
        lambda: raw.delete(b_hb),
        lambda: raw.keys("*"),
        lambda: raw.scan(),
        lambda: raw.flushall(),
        lambda: raw.eval("return redis.call('GET', KEYS[1])", 1, b_hb),
        lambda: raw.publish(f"{B}x", "y"),  # no pub/sub at all
        lambda: raw.config_get("*"),
        lambda: raw.acl_setuser("alpha", enabled=True, keys=["*"]),
    ]
    for call in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    # A's index pointed at B's prefix fails loudly on every call, naming the prefix
    wrong = RedisPrefixIndex(url_a, B)
    calls = {
        "match": lambda: wrong.match(h),
        "live_pods": wrong.live_pods,
        "sweep": wrong.sweep,
        "apply": lambda: wrong.apply("evil:1", h, []),
        "heartbeat": lambda: wrong.heartbeat("b-0.beta:50051", {"waiting": 0}, 60),
        "remove_pod": lambda: wrong.remove_pod("b-0.beta:50051"),
        "num_blocks": lambda: wrong.num_blocks("b-0.beta:50051"),
    }
    for name, call in calls.items():
        with pytest.raises(redis.exceptions.NoPermissionError) as e:
            call()
        if name != "num_blocks":  # a plain command's error is Redis's own
            assert repr(B) in str(e.value), (name, e.value)
    # B's entries are as B left them
    assert other.match(h) == {"b-0.beta:50051": 6}
    assert other.live_pods() == {"b-0.beta:50051": {"waiting": 9}}
    assert not s.client().hexists(f"{B}k:{h[0]}", "evil:1")
    assert {reason for reason, _ in _refusals(s, "alpha")} == {"key", "command"}
    assert _refusals(s, "beta") == []


def test_a_publisher_whose_user_is_refused_says_so(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong key prefix is a setting to fix, logged as an error naming it, not an outage."""
    url_a, _ = two_services(server)
    caplog.set_level(logging.INFO, logger="radixserve.scheduler.kv_events")
    hub = EventHub()
    sub = hub.subscribe(EventSubscriber())
    hub.publish([], lambda: [("stored", hashes_of(prompt(1, 2)))])
    pub = RedisPublisher(RedisPrefixIndex(url_a, B), "a-0.alpha:50051", sub, lambda: {}, 0.05, 1.0)
    pub.start()
    try:
        wait_until(lambda: pub.failures >= 2, what="the publisher's attempts")
    finally:
        pub.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "refuses this pod" in errors[0] and repr(B) in errors[0], errors
    assert "pw-alpha" not in caplog.text
    assert server.client().keys("*") == []


def test_liveness_survives_eviction_index_entries_go_first(caplog: pytest.LogCaptureFixture) -> None:
    """A full Redis evicts index entries (they carry a TTL), never heartbeats (they carry none): every
    live pod stays live. A heartbeat with a TTL, as the index once wrote them, is evicted."""
    with RedisServer(password="admin", maxmemory="3mb", maxmemory_policy=POLICY) as s:
        url_a, _ = two_services(s)
        idx = RedisPrefixIndex(url_a, A)
        admin = s.client()
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": POLICY}
        pods = [f"a-{i}.alpha:50051" for i in range(8)]
        for p in pods:
            assert idx.heartbeat(p, {"waiting": 1, "running": 2}, 600) is False
        idx.heartbeat("dead.alpha:50051", {}, 0.05)
        old_style = f"{A}p:old-style:hb"
        admin.set(old_style, '{"waiting": 1}', px=600_000)  # older than every entry below
        n, chunk = 0, 1000
        while admin.info("stats")["evicted_keys"] == 0 or admin.exists(old_style):
            idx.apply(pods[(n // chunk) % len(pods)], list(range(n, n + chunk)), [])
            n += chunk
            if n % (20 * chunk) == 0:  # pods beat meanwhile: their writes are never refused
                for p in pods:
                    assert idx.heartbeat(p, {"waiting": 1, "running": 2}, 600) is True
            assert n < 2_000_000, "no eviction"
        evicted = admin.info("stats")["evicted_keys"]
        print(f"\n{n} blocks written, {evicted} keys evicted, {admin.dbsize()} keys left")
        assert evicted > 0
        assert all(admin.exists(f"{A}p:{p}:hb") for p in pods)
        time.sleep(0.1)  # the dead pod's heartbeat has lapsed
        assert idx.live_pods() == {p: {"waiting": 1, "running": 2} for p in pods}
        assert all(idx.heartbeat(p, {"waiting": 1, "running": 2}, 600) is True for p in pods)
        assert idx.sweep() == ["dead.alpha:50051"]  # expiry as data still ends a dead pod
        # what is left of the index still routes (which entries went is LRU's choice, to the second)
        kept = next(k for k in admin.scan_iter(f"{A}k:*", count=1000))
        assert idx.match([int(kept.removeprefix(f"{A}k:"))]) == dict.fromkeys(admin.hkeys(kept), 1)
        assert _refusals(s, "alpha") == []


def test_tls_with_an_acl_user(caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer(password="admin", tls=True) as s:
        url_a, url_b = two_services(s)
        assert url_a.startswith("rediss://alpha:pw-alpha@127.0.0.1:") and "ssl_ca_certs=" in url_a
        reader = open_index(url_a, A)
        assert isinstance(reader, RedisPrefixIndex)
        assert reader.redis.connection_pool.connection_class is redis.SSLConnection
        assert "pw-alpha" not in reader.url
        # a scheduler's publisher feeds the gateway's index over TLS as user alpha
        hub = EventHub()
        sub = hub.subscribe(EventSubscriber())
        h = hashes_of(prompt(1, 4))
        hub.publish([], lambda: [("stored", h)])
        pub = RedisPublisher(
            RedisPrefixIndex(url_a, A), "a-0.alpha:50051", sub, lambda: {"waiting": 3}, 0.05, 1.0
        )
        pub.start()
        try:
            wait_until(lambda: reader.match(h) == {"a-0.alpha:50051": 4}, what="publishing over TLS")
            wait_until(lambda: reader.live_pods() == {"a-0.alpha:50051": {"waiting": 3}}, what="a heartbeat")
            hub.publish([("removed", h[2:])], lambda: [("stored", h[:2])])
            wait_until(lambda: reader.match(h) == {"a-0.alpha:50051": 2}, what="removed blocks")
        finally:
            pub.close()
        assert reader.match(h) == {} and reader.live_pods() == {}
        assert _refusals(s, "alpha") == []
        # the user's password counts, and its keys are still only its own
        wrong_pw = RedisPrefixIndex(s.url_for("alpha", "nope"), A)
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong_pw.live_pods()
        RedisPrefixIndex(url_b, B).heartbeat("b-0.beta:50051", {}, 60)
        with pytest.raises(redis.exceptions.NoPermissionError):
            RedisPrefixIndex(url_a, B).live_pods()
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(url_a).get(f"{B}p:b-0.beta:50051:hb")
