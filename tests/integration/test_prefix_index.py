"""The prefix index (in-memory and Redis backends, one suite for both), against a real redis-server
(tests/redis_server.py). The KV-event publisher that keeps a pod's entries in Redis is in
test_prefix_index_publisher.py, which shares the helpers and fixtures here."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from radixserve.common.prefix_index import RedisPrefixIndex, open_index, redact_url
from tests.helpers.prefix_index import (  # noqa: F401  (fixtures)
    BS,
    MODEL,
    Backend,
    backend_fixture,
    hashes_of,
    prompt,
    tls_server_fixture,
    wait_until,
)
from tests.redis_server import RedisServer, make_test_certs, redis_server_fixture  # noqa: F401


def test_match_counts_the_leading_blocks_each_pod_holds(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(1, 8))
    idx.apply("a", h, [])
    idx.apply("b", h[:3], [])
    assert idx.match(h) == {"a": 8, "b": 3}
    assert idx.match(h[:2]) == {"a": 2, "b": 2}
    assert idx.match([]) == {}
    # a prompt that leaves the cached path after block 5: only the shared prefix counts
    other = hashes_of(prompt(1, 8)[: 5 * BS] + prompt(2, 3))
    assert other[:5] == h[:5] and other[5] != h[5]
    assert idx.match(other) == {"a": 5, "b": 3}
    assert idx.match(hashes_of(prompt(3, 4))) == {}  # nobody holds the first block


def test_several_pods_with_different_prefix_lengths(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(7, 12))
    for n, pod in enumerate(["p1", "p2", "p3", "p4", "p5"], start=1):
        idx.apply(pod, h[: 2 * n], [])
    assert idx.match(h) == {"p1": 2, "p2": 4, "p3": 6, "p4": 8, "p5": 10}
    assert idx.match(h[:5]) == {"p1": 2, "p2": 4, "p3": 5, "p4": 5, "p5": 5}


def test_match_stops_at_the_first_block_no_still_matching_pod_holds(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(1, 6))
    idx.apply("a", [h[0], h[1], h[3], h[4]], [])  # a hole at block 2
    assert idx.match(h) == {"a": 2}
    # b holds blocks 2..5 but not the start: it never matched, so the walk still stops at block 2
    idx.apply("b", h[2:], [])
    assert idx.match(h) == {"a": 2}
    assert idx.match(h[2:]) == {"b": 4}  # a joins at block 3, after the walk started without it
    # c holds block 0 only: it drops out after block 0, a carries on
    idx.apply("c", h[:1], [])
    assert idx.match(h) == {"a": 2, "c": 1}


def test_stored_then_removed(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(1, 6))
    idx.apply("a", h, [])
    idx.apply("a", [], h[4:])  # the radix cache evicts leaves first
    assert idx.match(h) == {"a": 4}
    assert idx.num_blocks("a") == 4
    idx.apply("a", [], [12345, h[3]])  # removing a block it never had is harmless
    assert idx.match(h) == {"a": 3}
    idx.apply("a", h[3:5], h[:0])
    assert idx.match(h) == {"a": 5}


def test_cleared_drops_the_pods_old_entries_first(backend: Backend) -> None:
    idx = backend.index
    old, new = hashes_of(prompt(1, 5)), hashes_of(prompt(2, 3))
    idx.apply("a", old, [])
    idx.apply("b", old[:2], [])
    idx.apply("a", new, [], cleared=True)  # a snapshot: exactly what a holds now
    assert idx.match(old) == {"b": 2}
    assert idx.match(new) == {"a": 3}
    assert idx.num_blocks("a") == 3
    idx.apply("a", [], [], cleared=True)  # an empty snapshot: a holds nothing
    assert idx.match(new) == {} and idx.num_blocks("a") == 0


def test_a_snapshot_larger_than_one_write_replaces_a_large_old_one(backend: Backend) -> None:
    """Thousands of blocks (more than RedisPrefixIndex.CHUNK) cleared and written in pieces."""
    idx = backend.index
    old = hashes_of(prompt(1, 2500))
    new = hashes_of(prompt(2, 3000))
    idx.apply("a", old, [])
    idx.apply("b", old[:10], [])
    idx.apply("a", new, old[:0], cleared=True)
    assert idx.num_blocks("a") == 3000
    assert idx.match(old) == {"b": 10}
    assert idx.match(new[:125]) == {"a": 125}
    idx.apply("a", [], new[1500:])  # a large removal, in pieces too
    assert idx.num_blocks("a") == 1500
    assert idx.match(new[1490:1510]) == {"a": 10}


def test_remove_pod_leaves_the_other_pods_entries(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(1, 4))
    idx.apply("a", h, [])
    idx.apply("b", h[:2], [])
    idx.heartbeat("a", {"waiting": 1}, 60)
    idx.heartbeat("b", {"waiting": 2}, 60)
    idx.remove_pod("a")
    assert idx.match(h) == {"b": 2}
    assert idx.num_blocks("a") == 0 and idx.num_blocks("b") == 2
    assert idx.live_pods() == {"b": {"waiting": 2}}
    idx.remove_pod("nobody")  # harmless


def test_heartbeats_expire_and_sweep_removes_only_dead_pods(backend: Backend) -> None:
    idx, ttl = backend.index, backend.ttl_s
    h = hashes_of(prompt(1, 4))
    idx.apply("a", h, [])
    idx.apply("b", h[:3], [])
    assert idx.heartbeat("a", {"waiting": 3, "running": 1}, ttl) is False  # a first heartbeat
    assert idx.heartbeat("b", {"waiting": 0, "running": 2}, 100 * ttl) is False
    assert idx.heartbeat("a", {"waiting": 4, "running": 1}, ttl) is True  # still live: the latest load
    assert idx.live_pods() == {"a": {"waiting": 4, "running": 1}, "b": {"waiting": 0, "running": 2}}
    assert idx.sweep() == []
    backend.advance(ttl * 1.5)
    assert idx.live_pods() == {"b": {"waiting": 0, "running": 2}}  # a's heartbeat lapsed
    assert idx.match(h) == {"a": 4, "b": 3}  # its blocks stay until a sweep
    assert idx.sweep() == ["a"]
    assert idx.match(h) == {"b": 3}
    assert idx.num_blocks("a") == 0
    assert idx.sweep() == []
    assert idx.heartbeat("a", {}, ttl) is False  # a pod coming back learns it was gone


def test_sweep_removes_a_pod_that_published_blocks_but_never_a_heartbeat(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(1, 2))
    idx.apply("ghost", h, [])
    idx.apply("live", h, [])
    idx.heartbeat("live", {}, 60)
    assert idx.sweep() == ["ghost"]
    assert idx.match(h) == {"live": 2}


# ----------------------------------------------------------------------------------- Redis only
def test_redis_url_with_a_password() -> None:
    import redis

    with RedisServer(password="s3cret") as s:
        idx = RedisPrefixIndex(f"redis://:s3cret@{s.host}:{s.port}/0")
        h = hashes_of(prompt(1, 3))
        idx.apply("a", h, [])
        idx.heartbeat("a", {"waiting": 1}, 10)
        assert idx.match(h) == {"a": 3}
        assert idx.live_pods() == {"a": {"waiting": 1}}
        wrong = RedisPrefixIndex(f"redis://:nope@{s.host}:{s.port}/0")
        with pytest.raises(redis.AuthenticationError):
            wrong.match(h)
        anonymous = RedisPrefixIndex(f"redis://{s.host}:{s.port}/0")
        with pytest.raises(redis.RedisError, match=r"(?i)auth"):
            anonymous.match(h)


def test_rediss_url_with_a_password_and_the_ca_in_the_url(tls_server: RedisServer) -> None:
    import redis

    s = tls_server
    url = f"rediss://:s3cret@{s.host}:{s.port}/0?ssl_ca_certs={s.ca_file}"
    writer, reader = RedisPrefixIndex(url), open_index(url)  # a scheduler's and a gateway's
    assert isinstance(reader, RedisPrefixIndex)
    assert reader.redis.connection_pool.connection_class is redis.SSLConnection
    h = hashes_of(prompt(1, 6))
    writer.apply("a", h, [])
    writer.apply("b", h[:2], [])
    assert writer.heartbeat("a", {"waiting": 1}, 10) is False
    assert writer.heartbeat("a", {"waiting": 2}, 10) is True
    assert reader.match(h) == {"a": 6, "b": 2}
    assert reader.live_pods() == {"a": {"waiting": 2}}
    writer.apply("a", [], h[4:])  # removed events
    assert reader.match(h) == {"a": 4, "b": 2}
    assert reader.num_blocks("a") == 4
    assert reader.sweep() == ["b"]  # published blocks, never a heartbeat
    assert reader.match(h) == {"a": 4}
    writer.remove_pod("a")
    assert reader.match(h) == {} and reader.live_pods() == {}
    # the password still counts over TLS
    anonymous = RedisPrefixIndex(f"rediss://{s.host}:{s.port}/0?ssl_ca_certs={s.ca_file}")
    with pytest.raises(redis.RedisError, match=r"(?i)auth"):
        anonymous.match(h)
    # "localhost" is in the certificate too; a restart (same port, same certificate) is reconnected to
    by_name = RedisPrefixIndex(f"rediss://:s3cret@localhost:{s.port}/0?ssl_ca_certs={s.ca_file}")
    writer.apply("a", h, [])
    assert by_name.match(h) == {"a": 6}
    s.restart()  # empty
    assert by_name.match(h) == {}
    writer.apply("a", h[:3], [])
    assert by_name.match(h) == {"a": 3}


def test_rediss_verifies_the_servers_certificate(tls_server: RedisServer, tmp_path: Path) -> None:
    """Without the CA (the system's CAs only) or with another CA the handshake fails: the
    certificate is checked, not just encrypted to. Only ssl_cert_reqs=none skips that."""
    import redis

    s = tls_server
    h = hashes_of(prompt(1, 2))
    no_ca = RedisPrefixIndex(f"rediss://:s3cret@{s.host}:{s.port}/0")
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate verify failed"):
        no_ca.match(h)
    other_ca, _, _ = make_test_certs(str(tmp_path))
    wrong_ca = RedisPrefixIndex(f"rediss://:s3cret@{s.host}:{s.port}/0?ssl_ca_certs={other_ca}")
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate verify failed"):
        wrong_ca.match(h)
    unverified = RedisPrefixIndex(f"rediss://:s3cret@{s.host}:{s.port}/0?ssl_cert_reqs=none")
    assert unverified.match(h) == {}


def test_a_plain_redis_url_cannot_talk_to_the_tls_port(tls_server: RedisServer) -> None:
    import redis

    s = tls_server
    plain = RedisPrefixIndex(f"redis://:s3cret@{s.host}:{s.port}/0")
    t = time.perf_counter()
    with pytest.raises(redis.ConnectionError):
        plain.match(hashes_of(prompt(1, 2)))
    assert time.perf_counter() - t < 1.0  # the server drops it at once, no hang
    assert s.client().dbsize() == 0


def test_a_url_redis_cannot_use_fails_at_start_and_logs_never_show_the_password(tmp_path: Path) -> None:
    """A typo'd query parameter (or a TLS one on redis://) would otherwise fail every connection
    with a TypeError, and routing would stay on least-load for good; a missing CA file likewise."""
    with pytest.raises(ValueError, match="query parameter"):
        open_index("rediss://:pw@127.0.0.1:6390/0?sslcacerts=/tmp/ca.pem")
    with pytest.raises(ValueError, match="query parameter"):
        open_index(f"redis://127.0.0.1:6390/0?ssl_ca_certs={tmp_path}")
    with pytest.raises(ValueError, match=r"ssl_ca_certs=.*nope\.pem is not a file"):
        open_index(f"rediss://127.0.0.1:6390/0?ssl_ca_certs={tmp_path}/nope.pem")
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    index = open_index(f"rediss://app:s3cret@redis.example:6390/0?ssl_ca_certs={ca}")
    assert isinstance(index, RedisPrefixIndex)
    assert "s3cret" not in index.url and index.url.startswith("rediss://app:***@redis.example:6390/0?")
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def _top_level_calls(client: Any) -> dict[str, int]:
    """Per command, calls so far, without what scripts run inside (HGETALL) or INFO itself."""
    stats = client.info("commandstats")
    skip = {"cmdstat_hgetall", "cmdstat_info"}
    return {k: v["calls"] for k, v in stats.items() if k not in skip}


def test_redis_lookup_of_a_2000_token_prompt_is_one_call_and_fast(redis_server: RedisServer) -> None:
    idx = RedisPrefixIndex(redis_server.url)
    h = hashes_of(prompt(1, 125))  # 2000 tokens
    assert len(h) == 125
    idx.apply("a", h, [])
    idx.apply("b", h[:100], [])
    idx.apply("c", h[:60], [])
    assert idx.match(h) == {"a": 125, "b": 100, "c": 60}  # also loads the script
    stats = redis_server.client()
    before = _top_level_calls(stats)
    assert idx.match(h) == {"a": 125, "b": 100, "c": 60}
    after = _top_level_calls(stats)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    delta = {k: d for k, d in delta.items() if d}
    assert delta == {"cmdstat_evalsha": 1}, delta

    times = []
    for _ in range(200):
        t = time.perf_counter()
        idx.match(h)
        times.append(time.perf_counter() - t)
    times.sort()
    p50, p99 = statistics.median(times), times[int(0.99 * len(times)) - 1]
    # a figure for the docs (pytest -s), not a check: on a loaded machine any bound would be a guess
    print(f"\nRedis lookup of 125 block hashes (3 pods): p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms")


def test_redis_down_fails_fast_and_a_restarted_server_is_used_again(redis_server: RedisServer) -> None:
    import redis

    idx = RedisPrefixIndex(redis_server.url)
    h = hashes_of(prompt(1, 4))
    idx.apply("a", h, [])
    assert idx.match(h) == {"a": 4}
    redis_server.stop()
    for call in (lambda: idx.match(h), lambda: idx.apply("a", h, []), lambda: idx.heartbeat("a", {}, 1)):
        t = time.perf_counter()
        with pytest.raises(redis.ConnectionError):
            call()
        assert time.perf_counter() - t < 0.5  # no retries with backoff: the caller degrades at once
    redis_server.start()  # empty
    assert idx.match(h) == {}  # the pooled connection was stale: reconnected without an error
    idx.apply("a", h, [])
    assert idx.match(h) == {"a": 4}


def test_a_big_snapshot_lands_in_pieces_well_within_the_socket_timeout(redis_server: RedisServer) -> None:
    """One script for 20k blocks would run past a 0.1 s socket timeout (and block Redis, and every
    router's lookup, meanwhile); a publisher would then retry its snapshot forever."""
    idx = RedisPrefixIndex(redis_server.url, timeout_s=0.1)
    old, new = hashes_of(prompt(1, 20_000)), hashes_of(prompt(2, 20_000))
    idx.apply("a", old, [], cleared=True)
    idx.apply("a", new, [], cleared=True)
    assert idx.num_blocks("a") == 20_000
    assert idx.match(old[:10]) == {} and idx.match(new[-125:]) == {"a": 125}
    idx.remove_pod("a")
    assert idx.num_blocks("a") == 0 and idx.match(new[:10]) == {}
    assert redis_server.client().dbsize() == 0  # nothing left behind
    scripts = redis_server.client().info("commandstats")["cmdstat_evalsha"]
    assert scripts["usec_per_call"] < 50_000, scripts  # each a short while


def test_namespaces_do_not_see_each_other(redis_server: RedisServer) -> None:
    one, two = RedisPrefixIndex(redis_server.url, "one:"), RedisPrefixIndex(redis_server.url, "two:")
    h = hashes_of(prompt(1, 2))
    one.apply("a", h, [])
    two.heartbeat("b", {}, 10)
    assert one.match(h) == {"a": 2} and two.match(h) == {}
    assert one.live_pods() == {} and list(two.live_pods()) == ["b"]
