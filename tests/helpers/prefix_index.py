"""The prefix-index tests' shared pieces: prompts and their block hashes, both backends behind one
fixture (``backend``: the in-memory index on a fake clock, or Redis on a real redis-server), and a
TLS-only redis-server (``tls_server``). Import the fixtures by their ``*_fixture`` names."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from radixserve.common.block_hash import block_hashes
from radixserve.common.prefix_index import InMemoryPrefixIndex, RedisPrefixIndex
from tests.redis_server import RedisServer

MODEL = "m"
BS = 16


def hashes_of(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, MODEL, BS)


def prompt(seed: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of tokens; different seeds share no block."""
    return [seed * 100_000 + i for i in range(blocks * BS)]


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)
    return time.monotonic() - t0


# ------------------------------------------------------------------------- both backends, one suite
@dataclass
class Backend:
    index: Any
    advance: Callable[[float], None]  # let time pass (a fake clock, or really sleep)
    ttl_s: float


@pytest.fixture(params=["memory", "redis"], name="backend")  # named apart so modules can import it
def backend_fixture(request: pytest.FixtureRequest, clock: Any) -> Iterator[Backend]:
    if request.param == "memory":

        def tick(s: float) -> None:
            clock.t += s

        yield Backend(InMemoryPrefixIndex(clock=clock), tick, ttl_s=5.0)
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        yield Backend(RedisPrefixIndex(server.url, key_prefix="test:"), time.sleep, ttl_s=0.2)


# TLS: redis-server with only a TLS port and a throwaway CA (tests/redis_server.py). The URL carries
# the CA: redis-py's from_url passes query parameters it does not know (ssl_ca_certs, ssl_certfile,
# ssl_keyfile, ssl_cert_reqs) to the connection as strings, and rediss:// makes it a TLS one.
@pytest.fixture(name="tls_server")  # named apart so modules can import it (as tests/redis_server.py's)
def tls_server_fixture() -> Iterator[RedisServer]:
    with RedisServer(password="s3cret", tls=True) as server:
        yield server
