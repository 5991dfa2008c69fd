"""The cluster's prefix index: which scheduler pod holds which KV blocks (chained block hashes,
radixserve.common.block_hash), and which pods are alive (heartbeats that expire).

Two backends behind one interface:

* ``InMemoryPrefixIndex``: one process's dicts. The embedded default (``radixserve serve``): the
  gateway keeps it, fed by each scheduler's Watch stream (snapshot + block events + load).
* ``RedisPrefixIndex``: the cluster default. Schedulers write to it (their KV-event publisher),
  gateways read it. A whole prompt is looked up in one round trip (a server-side script that walks
  the prompt's blocks and stops at the first one no candidate pod holds).

Writers: ``apply`` (block events; ``cleared`` first drops everything the pod had), ``heartbeat``
(returns whether the pod's previous heartbeat was still live: False tells a publisher its entries
may be gone, a restarted or flushed Redis or a sweep after a stall, so it must republish them),
``remove_pod``. Readers: ``match`` (pod -> leading blocks held), ``live_pods``, ``sweep`` (remove
the entries of pods whose heartbeat expired).

Because the hash chains, a pod that holds block i holds the whole prefix up to it (the radix tree
evicts leaves first), so a pod's match is the longest run of leading blocks it appears in.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import redis

# A pod's load report (its heartbeat): a JSON object (Redis stores it as JSON text).
Load: TypeAlias = dict[str, object]


class PrefixIndex(Protocol):
    def apply(
        self, pod: str, stored: Sequence[int], removed: Sequence[int], cleared: bool = False
    ) -> None: ...
    def heartbeat(self, pod: str, load: Load, ttl_s: float) -> bool: ...
    def remove_pod(self, pod: str) -> None: ...
    def match(self, hashes: Sequence[int]) -> dict[str, int]: ...
    def live_pods(self) -> dict[str, Load]: ...
    def sweep(self) -> list[str]: ...


class InMemoryPrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pods_of: dict[int, set[str]] = {}  # block hash -> pods holding it
        self._blocks_of: dict[str, set[int]] = {}  # pod -> its block hashes
        self._heartbeats: dict[str, tuple[Load, float]] = {}  # pod -> (load, expires at)

    def apply(self, pod: str, stored: Sequence[int], removed: Sequence[int], cleared: bool = False) -> None:
        if cleared:
            self._drop_blocks(pod)
        mine = self._blocks_of.setdefault(pod, set())
        for h in stored:
            self._pods_of.setdefault(h, set()).add(pod)
            mine.add(h)
        for h in removed:
            pods = self._pods_of.get(h)
            if pods is not None:
                pods.discard(pod)
                if not pods:
                    del self._pods_of[h]
            mine.discard(h)

    def _drop_blocks(self, pod: str) -> None:
        for h in self._blocks_of.pop(pod, ()):
            pods = self._pods_of.get(h)
            if pods is not None:
                pods.discard(pod)
                if not pods:
                    del self._pods_of[h]

    def heartbeat(self, pod: str, load: Load, ttl_s: float) -> bool:
        now = self._clock()
        prev = self._heartbeats.get(pod)
        self._heartbeats[pod] = (load, now + ttl_s)
        return prev is not None and prev[1] > now

    def remove_pod(self, pod: str) -> None:
        self._drop_blocks(pod)
        self._heartbeats.pop(pod, None)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            pods = self._pods_of.get(h)
            if not pods:
                break
            alive = set(pods) if alive is None else alive & pods
            if not alive:
                break
            for p in alive:
                counts[p] = i + 1
        return counts

    def live_pods(self) -> dict[str, Load]:
        now = self._clock()
        return {p: load for p, (load, exp) in self._heartbeats.items() if exp > now}

    def sweep(self) -> list[str]:
        now = self._clock()
        dead = [p for p, (_, exp) in self._heartbeats.items() if exp <= now]
        dead += [p for p in self._blocks_of if p not in self._heartbeats]
        for p in dead:
            self.remove_pod(p)
        return dead

    def num_blocks(self, pod: str) -> int:
        return len(self._blocks_of.get(pod, ()))


# --------------------------------------------------------------------------------------- Redis
# Keys (standalone Redis; the scripts touch keys they compute, so not for Redis Cluster):
#   {ns}b:{hash}          SET of pods holding the block
#   {ns}p:{pod}:blocks    SET of the pod's block hashes (to drop them all at once)
#   {ns}p:{pod}:hb        the pod's last load (JSON), expiring: its heartbeat
#   {ns}pods              SET of pods that ever published (for sweeping)
_APPLY = """
local ns, pod = ARGV[1], ARGV[2]
local blocks = ns .. 'p:' .. pod .. ':blocks'
local n = tonumber(ARGV[3])
for i = 4, 3 + n do
  redis.call('SADD', ns .. 'b:' .. ARGV[i], pod)
  redis.call('SADD', blocks, ARGV[i])
end
for i = 4 + n, #ARGV do
  redis.call('SREM', ns .. 'b:' .. ARGV[i], pod)
  redis.call('SREM', blocks, ARGV[i])
end
redis.call('SADD', ns .. 'pods', pod)
return 1
"""

# Drops up to ARGV[3] of the pod's blocks and returns how many it still has: called until 0, so no
# single call blocks Redis for long however many blocks the pod had.
_CLEAR = """
local ns, pod = ARGV[1], ARGV[2]
local blocks = ns .. 'p:' .. pod .. ':blocks'
for _, h in ipairs(redis.call('SPOP', blocks, tonumber(ARGV[3]))) do
  redis.call('SREM', ns .. 'b:' .. h, pod)
end
return redis.call('SCARD', blocks)
"""

_MATCH = """
local ns = ARGV[1]
local alive = nil
local counts = {}
for i = 2, #ARGV do
  local members = redis.call('SMEMBERS', ns .. 'b:' .. ARGV[i])
  local next_alive = {}
  local any = false
  for _, m in ipairs(members) do
    if alive == nil or alive[m] then
      next_alive[m] = true
      counts[m] = i - 1
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for m, c in pairs(counts) do
  table.insert(out, m)
  table.insert(out, c)
end
return out
"""


class RedisPrefixIndex:
    """``url``: redis://[user:password@]host:port/db, or rediss:// for TLS: the server's certificate
    is checked against the system CAs, or a CA named in the URL
    (``rediss://:pw@redis:6379/0?ssl_ca_certs=/etc/redis-tls/ca.pem``; ``ssl_certfile`` /
    ``ssl_keyfile`` add a client certificate). A lookup is one round trip; errors (Redis down,
    timeouts) raise redis.RedisError for the caller to degrade on. A URL redis-py cannot use (an
    unknown query parameter, a CA file that is not there) is a ValueError here, at start, not a
    failure on every later connection.

    Writes go in scripts of at most ``CHUNK`` hashes, so a pod's snapshot (100k+ blocks on a big
    GPU) never runs into the socket timeout nor blocks Redis, and every router's lookup, for long.
    A snapshot is therefore not atomic: while it lands, routers see part of the pod's blocks (a
    shorter match, never a wrong one)."""

    CHUNK = 1024

    def __init__(self, url: str, namespace: str = "radixserve:", timeout_s: float = 0.25) -> None:
        import redis

        self.url = redact_url(url)  # for logs: never the password
        self.ns = namespace
        self.redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        _check_connection_args(self.redis.connection_pool, self.url)
        self._apply = self.redis.register_script(_APPLY)
        self._clear = self.redis.register_script(_CLEAR)
        self._match = self.redis.register_script(_MATCH)

    def apply(self, pod: str, stored: Sequence[int], removed: Sequence[int], cleared: bool = False) -> None:
        if cleared:
            self._drop_blocks(pod)
        if len(stored) + len(removed) <= self.CHUNK:  # a step's events: one round trip
            self._apply(args=[self.ns, pod, len(stored), *stored, *removed])
            return
        for i in range(0, len(stored), self.CHUNK):
            chunk = stored[i : i + self.CHUNK]
            self._apply(args=[self.ns, pod, len(chunk), *chunk])
        for i in range(0, len(removed), self.CHUNK):
            self._apply(args=[self.ns, pod, 0, *removed[i : i + self.CHUNK]])

    def _drop_blocks(self, pod: str) -> None:
        while int(self._clear(args=[self.ns, pod, self.CHUNK])) > 0:
            pass

    def heartbeat(self, pod: str, load: Load, ttl_s: float) -> bool:
        key = f"{self.ns}p:{pod}:hb"
        pipe = self.redis.pipeline(transaction=True)  # one round trip (SET ... GET needs Redis 6.2)
        pipe.exists(key)
        pipe.set(key, json.dumps(load), px=max(1, int(ttl_s * 1000)))
        pipe.sadd(f"{self.ns}pods", pod)
        existed, _, _ = pipe.execute()
        return bool(existed)

    def remove_pod(self, pod: str) -> None:
        self._drop_blocks(pod)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(f"{self.ns}p:{pod}:blocks", f"{self.ns}p:{pod}:hb")
        pipe.srem(f"{self.ns}pods", pod)
        pipe.execute()

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        flat = self._match(args=[self.ns, *hashes])
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def live_pods(self) -> dict[str, Load]:
        pods = sorted(map(str, self.redis.smembers(f"{self.ns}pods")))
        if not pods:
            return {}
        loads = self.redis.mget([f"{self.ns}p:{p}:hb" for p in pods])
        return {p: json.loads(v) for p, v in zip(pods, loads, strict=True) if v is not None}

    def sweep(self) -> list[str]:
        pods = sorted(map(str, self.redis.smembers(f"{self.ns}pods")))
        if not pods:
            return []
        beats = self.redis.mget([f"{self.ns}p:{p}:hb" for p in pods])
        dead = [p for p, v in zip(pods, beats, strict=True) if v is None]
        for p in dead:
            self.remove_pod(p)
        return dead

    def num_blocks(self, pod: str) -> int:
        return int(self.redis.scard(f"{self.ns}p:{pod}:blocks"))


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _check_connection_args(pool: redis.ConnectionPool, shown_url: str) -> None:
    # redis-py hands unknown URL query parameters to the connection class as they are, so a typo
    # (or ssl_ca_certs on a redis:// URL) would only fail at connect time, with a TypeError, on
    # every attempt: the router would degrade to least-load for good with a vague warning.
    try:
        pool.connection_class(**pool.connection_kwargs)  # builds the object; connects lazily
    except TypeError as e:
        raise ValueError(f"prefix index {shown_url}: a query parameter redis cannot use ({e})") from None
    for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = pool.connection_kwargs.get(key)
        if path and not Path(path).is_file():
            raise ValueError(f"prefix index {shown_url}: {key}={path} is not a file")


def open_index(spec: str) -> InMemoryPrefixIndex | RedisPrefixIndex:
    """ "memory" or a redis:// / rediss:// URL."""
    if spec == "memory":
        return InMemoryPrefixIndex()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisPrefixIndex(spec)
    raise ValueError(f"prefix index {spec!r}: expected 'memory' or a redis:// / rediss:// URL")
