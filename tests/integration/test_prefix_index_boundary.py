"""The prefix index at its boundary: bad input (both backends), the Redis key layout (the key
prefix; which keys carry a TTL, so that eviction takes index entries and never heartbeats),
heartbeats in Redis that are not ours, and the ACL rules of a service's Redis user. With a real
redis-server (tests/redis_server.py); ACL users and eviction for real are in
tests/integration/test_redis_security.py."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from radixserve.common.prefix_index import (
    REDIS_COMMANDS,
    RedisPrefixIndex,
    acl_rules,
    check_pod,
    clean_load,
    open_index,
)
from tests.helpers.prefix_index import Backend, backend_fixture, hashes_of, prompt  # noqa: F401
from tests.redis_server import RedisServer, redis_server_fixture  # noqa: F401


# ------------------------------------------------------------------------------ bad input, both
def test_a_removed_event_for_blocks_the_pod_never_stored_touches_nothing(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(1, 4))
    idx.apply("a", h, [])
    idx.apply("b", [], h)  # b never held them: a keeps every one
    idx.apply("b", [], [7, 8, 9], cleared=True)
    assert idx.match(h) == {"a": 4}
    assert idx.num_blocks("a") == 4 and idx.num_blocks("b") == 0


BAD_HASHES: list[Any] = [-1, 1 << 64, "17", 1.5, True, None, b"\x01"]


def test_hashes_out_of_range_are_dropped_with_a_warning(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    idx = backend.index
    h = hashes_of(prompt(1, 4))
    with caplog.at_level(logging.WARNING, logger="radixserve.common.prefix_index"):
        idx.apply("a", [*h[:2], *BAD_HASHES, *h[2:]], [])
        idx.apply("a", [], [-5, (1 << 64) + h[3], "x"])  # nothing removed: h[3] stays
    assert idx.match(h) == {"a": 4} and idx.num_blocks("a") == 4
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 2
    assert "7 stored block hash(es) of a ignored" in caplog.records[0].getMessage()
    # a lookup's chain ends at the first bad hash; the largest valid hash is a hash like any other
    assert idx.match([*h[:2], -1, *h[2:]]) == {"a": 2}
    assert idx.match(["x", *h]) == {}
    idx.apply("b", [(1 << 64) - 1, 0], [])
    assert idx.match([(1 << 64) - 1]) == {"b": 1} and idx.match([0]) == {"b": 1}


def test_a_malformed_load_is_cleaned_and_the_heartbeat_still_counts(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    idx = backend.index
    load = {
        "waiting": 3,
        "kv": 0.5,
        "draining": False,
        "address": "pod-a:1",
        "nan": float("nan"),
        "inf": float("inf"),
        "nested": {"x": 1},
        "list": [1],
        "long": "x" * 10_000,
        "huge": 10**40,
        "obj": object(),
        7: "not a str key",
    }
    with caplog.at_level(logging.WARNING, logger="radixserve.common.prefix_index"):
        assert idx.heartbeat("a", load, 60) is False
        assert idx.heartbeat("b", ["not", "a", "mapping"], 60) is False  # type: ignore[arg-type]
        assert idx.heartbeat("c", "waiting=3", 60) is False  # type: ignore[arg-type]
    assert idx.live_pods() == {
        "a": {"waiting": 3, "kv": 0.5, "draining": False, "address": "pod-a:1"},
        "b": {},
        "c": {},
    }
    assert len(caplog.records) == 3, [r.getMessage() for r in caplog.records]
    assert idx.heartbeat("a", {"waiting": 1}, 60) is True  # still alive, as it was


def test_check_pod_and_clean_load_are_the_boundary() -> None:
    assert check_pod("10.0.0.7:50051") == "10.0.0.7:50051"
    for bad in ["", "a b", "a\nb", "x" * 257, None, 5]:
        with pytest.raises(ValueError, match="pod name"):
            check_pod(bad)
    assert clean_load({"waiting": 2, "running": None}) == {"waiting": 2, "running": None}
    assert clean_load({f"k{i}": i for i in range(100)}) == {f"k{i}": i for i in range(64)}


# ----------------------------------------------------------------------- Redis: keys and eviction
def test_every_key_starts_with_the_prefix_and_only_index_entries_carry_a_ttl(
    redis_server: RedisServer,
) -> None:
    idx = RedisPrefixIndex(redis_server.url, "rs:ns/svc:", entry_ttl_s=600)
    assert idx.key_prefix == "rs:ns/svc:"
    h = hashes_of(prompt(1, 3))
    idx.apply("a:1", h, [])
    idx.apply("b:1", h[:1], [])
    idx.heartbeat("a:1", {"waiting": 1}, 5)
    c = redis_server.client()
    keys = sorted(c.keys("*"))
    assert keys == sorted(
        ["rs:ns/svc:pods", "rs:ns/svc:p:a:1:hb", "rs:ns/svc:p:a:1:blocks", "rs:ns/svc:p:b:1:blocks"]
        + [f"rs:ns/svc:k:{x}" for x in h]
    )
    ttls = {k: c.pttl(k) for k in keys}
    never = {k for k, t in ttls.items() if t == -1}
    assert never == {"rs:ns/svc:pods", "rs:ns/svc:p:a:1:hb"}  # volatile-lru never evicts these
    assert all(590_000 < t <= 600_000 for k, t in ttls.items() if k not in never), ttls
    # the heartbeat's expiry is data, on Redis's clock
    exp, _, body = c.get("rs:ns/svc:p:a:1:hb").partition(" ")
    now_ms = int(c.time()[0]) * 1000
    assert 3_000 < int(exp) - now_ms <= 6_000 and body == '{"waiting":1}'
    # the default prefix: as before, so a reader that passes none (the operator's) still finds the keys
    default = RedisPrefixIndex(redis_server.url)
    default.heartbeat("z:1", {}, 5)
    assert c.exists("radixserve:p:z:1:hb") and list(open_index(redis_server.url).live_pods()) == ["z:1"]
    assert list(open_index(redis_server.url, "rs:ns/svc:").live_pods()) == ["a:1"]
    with pytest.raises(ValueError, match="key prefix"):
        RedisPrefixIndex(redis_server.url, "")


def test_index_entries_expire_when_nobody_writes_them_and_writes_refresh_them(
    redis_server: RedisServer,
) -> None:
    # the TTL with room for a loaded machine: the new entries are checked 0.8 s before they expire
    idx = RedisPrefixIndex(redis_server.url, entry_ttl_s=2.0)
    old, new = hashes_of(prompt(1, 3)), hashes_of(prompt(2, 3))
    idx.apply("a", old, [])
    idx.heartbeat("a", {}, 60)
    time.sleep(1.2)
    idx.apply("a", new, [])  # refreshes a's block list, not old's block keys
    time.sleep(1.2)
    assert idx.match(old) == {} and idx.match(new) == {"a": 3}
    assert idx.num_blocks("a") == 6  # its list lives on: written 1.2 s ago
    assert idx.live_pods() == {"a": {}}  # the heartbeat never expires by TTL


def test_unreadable_heartbeats_in_redis_are_dead_pods_not_errors(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever else wrote under the prefix (an older version, a bug, a hand): never a crash."""
    idx = RedisPrefixIndex(redis_server.url)
    h = hashes_of(prompt(1, 2))
    c = redis_server.client()
    idx.heartbeat("good", {"waiting": 1}, 60)
    forged = {
        "text": "garbage",
        "json-array": "99999999999999 [1, 2]",
        "bad-json": "99999999999999 {nope",
        "no-expiry": '{"waiting": 1}',  # an old-style heartbeat
        "unicode-digits": "\u00b2\u00b3 {}",
    }
    for pod, value in forged.items():
        idx.apply(pod, h, [])
        c.set(f"radixserve:p:{pod}:hb", value)
    idx.apply("a-set", h, [])
    c.sadd("radixserve:p:a-set:hb", "x")  # another type
    with caplog.at_level(logging.WARNING, logger="radixserve.common.prefix_index"):
        assert idx.live_pods() == {"good": {"waiting": 1}}
        assert sorted(idx.sweep()) == sorted([*forged, "a-set"])
    assert len([r for r in caplog.records if "unreadable heartbeat" in r.getMessage()]) >= len(forged)
    assert idx.match(h) == {} and idx.live_pods() == {"good": {"waiting": 1}}
    c.sadd("radixserve:p:x:hb", "x")
    assert idx.heartbeat("x", {}, 60) is False  # a key of another type is overwritten
    assert idx.live_pods() == {"good": {"waiting": 1}, "x": {}}


# ------------------------------------------------------------------------------------- ACL rules
def test_acl_rules_limit_a_user_to_its_prefix_and_the_commands_the_index_sends() -> None:
    rules = acl_rules("rs:default/llama:")
    assert rules[:6] == [
        "on",
        "resetkeys",
        "~rs:default/llama:*",
        "resetchannels",
        "&rs:default/llama:*",
        "-@all",
    ]
    assert rules[6:] == [f"+{c}" for c in REDIS_COMMANDS]
    assert acl_rules("p:", password="pw")[:3] == ["on", "resetpass", ">pw"]
    assert "~we\\*ird\\?:*" in acl_rules("we*ird?:")  # glob characters match only themselves
    assert not {"keys", "flushall", "flushdb", "eval", "config", "acl", "scan"} & set(REDIS_COMMANDS)
    for bad in ["", "rs:ns/a", "rs ns:", "rs:\n:"]:
        with pytest.raises(ValueError, match="key prefix"):
            acl_rules(bad)
