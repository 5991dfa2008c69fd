"""The cache-aware router over a real Redis prefix index that goes away and comes back."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from radixserve.common.prefix_index import RedisPrefixIndex
from radixserve.tokenizer.routing import router as router_module
from radixserve.tokenizer.routing.router import CacheAwareRouter
from tests.helpers.routing import BS, MODEL, hashes_of, pod, tokens
from tests.redis_server import RedisServer, redis_server_fixture  # noqa: F401  (the redis_server fixture)


def test_index_down_falls_back_to_least_load_and_retries_later(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="radixserve.tokenizer.routing.router")
    index = RedisPrefixIndex(redis_server.url)
    a, b = pod("a", running=3), pod("b")
    ids = tokens(1, 5)
    index.apply("a", hashes_of(ids), [])
    router = CacheAwareRouter(index, MODEL, BS, retry_s=30)
    assert router.choose(ids, [a, b]) is a
    assert router.decisions[-1].reason == "prefix"

    redis_server.stop()
    t = time.perf_counter()
    assert router.choose(ids, [a, b]) is b
    assert time.perf_counter() - t < 0.5  # a refused connection does not stall the gateway
    d = router.decisions[-1]
    assert (d.pod, d.reason, d.matched_blocks) == ("b", "index-down", 0)
    warnings = [r.message for r in caplog.records if r.name == "radixserve.tokenizer.routing.router"]
    assert len(warnings) == 1 and "prefix index unreachable" in warnings[0]
    for _ in range(3):  # within retry_s the index is not even tried
        assert router.choose(ids, [a, b]) is b
        assert router.decisions[-1].reason == "index-down"
    assert len([r for r in caplog.records if r.name == "radixserve.tokenizer.routing.router"]) == 1

    redis_server.start()  # empty: the pod republishes (its RedisPublisher does that)
    index.apply("a", hashes_of(ids), [])
    assert router.choose(ids, [a, b]).address == "b"  # still within retry_s
    assert router.decisions[-1].reason == "index-down"
    # retry_s later (the router's clock moved on: a real wait this long would only slow the suite,
    # a short retry_s made "still within" depend on how fast Redis restarts)
    later = time.monotonic() + 31
    monkeypatch.setattr(
        router_module, "time", SimpleNamespace(monotonic=lambda: later, perf_counter=time.perf_counter)
    )
    assert router.choose(ids, [a, b]) is a
    d = router.decisions[-1]
    assert (d.pod, d.reason, d.matched_blocks) == ("a", "prefix", 5)
