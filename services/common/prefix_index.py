"""The cluster's prefix index: which scheduler pod holds which KV blocks (chained block hashes,
radixserve.common.block_hash), and which pods are alive (heartbeats that expire).

Two backends behind one interface:

* ``InMemoryPrefixIndex``: one process's dicts. The embedded default (``radixserve serve``): the
  gateway keeps it, fed by each scheduler's Watch stream (snapshot + block events + load).
* ``RedisPrefixIndex``: the cluster default. Schedulers write to it (their KV-event publisher),
  gateways read it. A whole prompt is looked up in one round trip (a server-side script that walks
  the prompt's blocks and stops at the first one no candidate pod holds).

Writers: ``apply`` (block events, each stored block with its tier, ``tiers``: common/kv_tier.py;
``cleared`` first drops everything the pod had; ``location``: the pod's shared disk directory, under
which its disk blocks go), ``heartbeat`` (returns whether the pod's previous heartbeat was still
live: False tells a publisher its entries may be gone, a restarted or flushed Redis or a sweep after
a stall, so it must republish them), ``remove_pod``. Readers: ``match_tiers`` (pod -> leading blocks
by the best tier it can load each from, its shared directory's included), ``match`` (pod -> leading
blocks on any tier), ``live_pods``, ``sweep`` (remove the entries of pods whose heartbeat expired).
The in-memory index is in prefix_index_memory.py, the checks of what pods write in
prefix_index_input.py.

Because the hash chains, a pod that holds block i holds the whole prefix up to it (the radix tree
evicts leaves first), so a pod's match is the longest run of leading blocks it appears in.

Redis: isolation, eviction, bad input
-------------------------------------
Every key starts with the index's key prefix (``INDEX_KEY_PREFIX`` by default; the operator gives
each InferenceService ``rs:<namespace>/<name>:``), and the index uses no pub/sub channel. A
service's Redis user may be limited to its prefix and to the commands in ``REDIS_COMMANDS``:
``acl_rules(prefix)`` builds the ``ACL SETUSER`` rules. An index whose user may not touch its keys
fails loudly (redis.exceptions.NoPermissionError on every call), never silently.

Liveness must survive memory pressure; the index need not. So the two kinds of keys differ:

* index entries (``k:<hash>``, ``p:<pod>:blocks``) carry a Redis TTL (``entry_ttl_s``, refreshed
  whenever a pod writes them): they are what ``maxmemory-policy volatile-lru`` may evict, the
  least recently used (lookups count as use) first;
* heartbeats (``p:<pod>:hb``) and the pod list (``pods``) carry none, so no ``volatile-*`` policy
  ever evicts them: a heartbeat's expiry is data in its value (on Redis's clock, ``TIME``), readers
  treat one past it as dead, and ``sweep`` removes it with the pod's entries.

With ``volatile-lru`` (what the chart's Redis must run with) a full Redis therefore forgets some
blocks, never a pod: routing sees shorter matches (fewer cache hits, never a wrong pod; a forgotten
block comes back when a pod stores it again, a pod's whole set at its next snapshot), while
``live_pods`` (the routers' and the autoscaler's view of which pods are up and how loaded) stays
whole. (``allkeys-*`` would evict heartbeats, so healthy pods would look dead; ``noeviction`` would
refuse the heartbeats' writes once full.) Entries nobody writes for ``entry_ttl_s`` expire: a block
a pod holds longer than that without storing it again drops out of the index until its next
snapshot or store.

Input is checked at this boundary: a block hash that is not an int in [0, 2**64) is dropped (a
chain ends there), a ``removed`` block the pod did not hold is a no-op, a load field that is not a
short string, a finite number, a bool or null is dropped from the heartbeat (the heartbeat itself,
liveness, is still written), and a stored heartbeat that cannot be read is a dead pod; each is
logged, none raises or reaches another pod's entries.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.common import prefix_index_lua as lua
from radixserve.common.kv_tier import TierMatch, disk_location_key
from radixserve.common.prefix_index_input import Load as Load
from radixserve.common.prefix_index_input import check_pod as check_pod
from radixserve.common.prefix_index_input import clean_hashes, clean_load, clean_location, clean_stored
from radixserve.common.prefix_index_memory import InMemoryPrefixIndex as InMemoryPrefixIndex
from radixserve.common.service_config import INDEX_KEY_PREFIX

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

# Every Redis command a RedisPrefixIndex sends (as ACL names, "container|subcommand"), those its
# scripts run included: what a service's Redis user needs, and all it gets (acl_rules). At connect
# redis-py sends AUTH (which every user may send), SELECT for a database other than 0, and CLIENT
# SETINFO, which we turn off (Redis before 7.2 has no such command for an ACL rule to name; refused,
# it would fill the ACL LOG). Scripts: EVALSHA, and SCRIPT LOAD when the server does not have them
# yet (after a restart). PING: for readiness checks.
REDIS_COMMANDS: tuple[str, ...] = (
    "select",
    "ping",
    "evalsha",
    "script|load",
    "time",
    "get",
    "set",
    "del",
    "pexpire",
    "sadd",
    "srem",
    "spop",
    "scard",
    "smembers",
    "hset",
    "hdel",
    "hgetall",
)

# How long an index entry (a block's pods, a pod's blocks) lives after it was last written.
ENTRY_TTL_S = 24 * 3600.0

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def acl_rules(prefix: str, password: str | None = None) -> list[str]:
    """The ``ACL SETUSER <user> ...`` rules of a service whose index uses key prefix ``prefix``: on,
    its keys only (``~<prefix>*``), its channels only (``&<prefix>*``; the index uses none), and
    only ``REDIS_COMMANDS``. ``password``: its password, as ``resetpass >password`` (otherwise
    the caller adds ``>password``). ``prefix`` must end with ":" so that one service's pattern never
    covers another's keys (``rs:ns/a*`` would cover ``rs:ns/ab:``)."""
    if not prefix.endswith(":") or not prefix.isprintable() or any(c.isspace() for c in prefix):
        raise ValueError(f"key prefix {prefix!r}: expected printable text without spaces, ending with ':'")
    pattern = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
    rules = ["on"]
    if password is not None:
        if not password:
            raise ValueError("an empty password")
        rules += ["resetpass", f">{password}"]
    rules += ["resetkeys", f"~{pattern}", "resetchannels", f"&{pattern}", "-@all"]
    return rules + [f"+{c}" for c in REDIS_COMMANDS]


class PrefixIndex(Protocol):
    def apply(
        self,
        pod: str,
        stored: Sequence[int],
        removed: Sequence[int],
        cleared: bool = False,
        tiers: Sequence[int] = (),
        location: str = "",
    ) -> None: ...
    def heartbeat(self, pod: str, load: Load, ttl_s: float) -> bool: ...
    def remove_pod(self, pod: str) -> None: ...
    def match(self, hashes: Sequence[int]) -> dict[str, int]: ...
    def match_tiers(
        self, hashes: Sequence[int], locations: Mapping[str, str] | None = None
    ) -> dict[str, TierMatch]: ...
    def live_pods(self) -> dict[str, Load]: ...
    def sweep(self) -> list[str]: ...


# --------------------------------------------------------------------------------------- Redis
# Keys and scripts: radixserve.common.prefix_index_lua.


class RedisPrefixIndex:
    """``url``: redis://[user:password@]host:port/db, or rediss:// for TLS: the server's certificate
    is checked against the system CAs, or a CA named in the URL
    (``rediss://:pw@redis:6379/0?ssl_ca_certs=/etc/redis-tls/ca.pem``; ``ssl_certfile`` /
    ``ssl_keyfile`` add a client certificate). A lookup is one round trip; errors (Redis down,
    timeouts, a user not allowed the keys: NoPermissionError) raise redis.RedisError for the caller
    to degrade on. A URL redis-py cannot use (an unknown query parameter, a CA file that is not
    there) is a ValueError here, at start, not a failure on every later connection.

    ``key_prefix``: every key starts with it (module docstring). ``entry_ttl_s``: how long an
    index entry outlives its last write (heartbeats carry their own expiry, as data).

    Writes go in scripts of at most ``CHUNK`` hashes, so a pod's snapshot (100k+ blocks on a big
    GPU) never runs into the socket timeout nor blocks Redis, and every router's lookup, for long.
    A snapshot is therefore not atomic: while it lands, routers see part of the pod's blocks (a
    shorter match, never a wrong one)."""

    CHUNK = 1024

    def __init__(
        self,
        url: str,
        key_prefix: str = INDEX_KEY_PREFIX,
        timeout_s: float = 0.25,
        entry_ttl_s: float = ENTRY_TTL_S,
    ) -> None:
        import redis

        if not isinstance(key_prefix, str) or not key_prefix or not key_prefix.isprintable():
            raise ValueError(f"key prefix {key_prefix!r}: expected non-empty printable text")
        if not entry_ttl_s >= 0.001:
            raise ValueError(f"entry_ttl_s={entry_ttl_s}: expected at least 0.001 s")
        self.url = redact_url(url)  # for logs: never the password
        self.ns = key_prefix
        self.entry_ttl_ms = int(entry_ttl_s * 1000)
        self.redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
            **_no_client_setinfo(),
        )
        _check_connection_args(self.redis.connection_pool, self.url)
        self._apply = self.redis.register_script(lua.APPLY)
        self._clear = self.redis.register_script(lua.CLEAR)
        self._forget = self.redis.register_script(lua.FORGET)
        self._beat = self.redis.register_script(lua.BEAT)
        self._pods = self.redis.register_script(lua.PODS)
        self._match = self.redis.register_script(lua.MATCH)

    @property
    def key_prefix(self) -> str:
        return self.ns

    def _run(self, script: redis.commands.core.Script, args: list[str | int]) -> Any:
        """Runs one of our scripts. Redis reports a key (or command) the user may not use, from
        inside a script, as a plain error: raised here as the NoPermissionError it is, naming the
        prefix."""
        import redis

        try:
            return script(args=args)
        except redis.exceptions.ResponseError as e:
            text = str(e)
            if isinstance(e, redis.exceptions.NoPermissionError) or any(
                s in text.lower() for s in ("noperm", "no permissions", "can't access")
            ):
                why = f"this Redis user may not use the keys under {self.ns!r} or a command on them ({text})"
                raise redis.exceptions.NoPermissionError(f"prefix index {self.url}: {why}") from e
            raise

    def apply(
        self,
        pod: str,
        stored: Sequence[int],
        removed: Sequence[int],
        cleared: bool = False,
        tiers: Sequence[int] = (),
        location: str = "",
    ) -> None:
        check_pod(pod)
        loc = clean_location(location, pod)
        loc = disk_location_key(loc) if loc else ""
        pairs, removed = clean_stored(stored, tiers, pod), clean_hashes(removed, pod, "removed")
        if cleared:
            self._drop_blocks(pod)
        head: list[str | int] = [self.ns, pod, self.entry_ttl_ms, loc]
        flat = [x for pair in pairs for x in pair]  # hash, tier, hash, tier, ...
        unheld = 0
        if len(pairs) + len(removed) <= self.CHUNK:  # a step's events: one round trip
            unheld = int(self._run(self._apply, [*head, len(pairs), *flat, *removed]))
        else:
            for i in range(0, len(flat), 2 * self.CHUNK):
                chunk = flat[i : i + 2 * self.CHUNK]
                self._run(self._apply, [*head, len(chunk) // 2, *chunk])
            for i in range(0, len(removed), self.CHUNK):
                unheld += int(self._run(self._apply, [*head, 0, *removed[i : i + self.CHUNK]]))
        if unheld:  # normal: stored and removed before a write, or an entry Redis evicted
            log.debug("prefix index: %d removed block(s) of %s were not in the index", unheld, pod)

    def _drop_blocks(self, pod: str) -> None:
        while int(self._run(self._clear, [self.ns, pod, self.CHUNK])) > 0:
            pass

    def heartbeat(self, pod: str, load: Load, ttl_s: float) -> bool:
        check_pod(pod)
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"heartbeat ttl_s={ttl_s}: expected a positive number of seconds")
        body = json.dumps(clean_load(load, pod), separators=(",", ":"))
        return bool(self._run(self._beat, [self.ns, pod, max(1, int(ttl_s * 1000)), body]))

    def remove_pod(self, pod: str) -> None:
        self._drop_blocks(pod)
        self._run(self._forget, [self.ns, pod])

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        return {p: m.blocks for p, m in self.match_tiers(hashes).items()}

    def match_tiers(
        self, hashes: Sequence[int], locations: Mapping[str, str] | None = None
    ) -> dict[str, TierMatch]:
        """Per pod, its leading blocks by the best tier it can load each from: its own, or (disk) its
        shared location's, ``locations`` naming each pod's (a pod left out: its own entries only)."""
        hashes = clean_hashes(hashes, "a lookup", "looked-up", chain=True)
        if not hashes:
            return {}
        at = [x for pod, loc in (locations or {}).items() if loc for x in (pod, disk_location_key(loc))]
        flat = self._run(self._match, [self.ns, len(at) // 2, *at, *hashes])
        return {flat[i]: TierMatch(*map(int, flat[i + 1 : i + 4])) for i in range(0, len(flat), 4)}

    def _heartbeats(self) -> tuple[dict[str, Load], list[str]]:
        """(live pods and their loads, pods whose heartbeat expired, is missing or unreadable)."""
        flat = self._run(self._pods, [self.ns])
        now = int(flat[0])
        live: dict[str, Load] = {}
        dead: list[str] = []
        for i in range(1, len(flat), 2):
            pod, value = str(flat[i]), flat[i + 1]
            beat = _parse_heartbeat(pod, value) if value is not None else None
            if beat is not None and beat[0] > now:
                live[pod] = beat[1]
            else:
                dead.append(pod)
        return dict(sorted(live.items())), sorted(dead)

    def live_pods(self) -> dict[str, Load]:
        return self._heartbeats()[0]

    def sweep(self) -> list[str]:
        dead = self._heartbeats()[1]
        for p in dead:
            self.remove_pod(p)
        return dead

    def num_blocks(self, pod: str) -> int:
        return int(self.redis.scard(f"{self.ns}p:{pod}:blocks"))


def _no_client_setinfo() -> dict[str, None]:
    """redis-py's arguments that keep it from sending CLIENT SETINFO at connect."""
    try:
        import redis.driver_info  # noqa: F401  newer redis-py: lib_name / lib_version deprecated
    except ImportError:
        return {"lib_name": None, "lib_version": None}
    return {"driver_info": None}


def _parse_heartbeat(pod: str, value: str) -> tuple[int, Load] | None:
    """(expires at, load) of a stored heartbeat, None (a warning) for one that is not ours."""
    exp, _, body = value.partition(" ")
    try:
        load = json.loads(body)
        if not (exp.isascii() and exp.isdigit()) or not isinstance(load, dict):
            raise ValueError("not '<expiry ms> <JSON object>'")
    except ValueError as e:  # json.JSONDecodeError included
        log.warning("prefix index: unreadable heartbeat of %s (%s): a dead pod", pod, str(e)[:80])
        return None
    return int(exp), clean_load(load, pod)


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


# Gateways report their own load (requests held for want of a scheduler: the signal that scales a
# service from zero) as heartbeats of a second index under the service's prefix plus this: never
# among the schedulers discovery finds, and within the prefix a service's Redis user is limited to.
GATEWAY_REPORTS = "gw:"


def gateway_reports(
    url: str, key_prefix: str = INDEX_KEY_PREFIX, timeout_s: float = 0.25
) -> RedisPrefixIndex:
    """Where the gateways of the index at ``url`` / ``key_prefix`` publish their load reports
    (``heartbeat(gateway, {"held": n, ...})``) and the operator reads them (``live_pods``)."""
    return RedisPrefixIndex(url, key_prefix + GATEWAY_REPORTS, timeout_s)


def open_index(spec: str, key_prefix: str = INDEX_KEY_PREFIX) -> InMemoryPrefixIndex | RedisPrefixIndex:
    """ "memory" or a redis:// / rediss:// URL (whose keys start with ``key_prefix``)."""
    if spec == "memory":
        return InMemoryPrefixIndex()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisPrefixIndex(spec, key_prefix)
    raise ValueError(f"prefix index {spec!r}: expected 'memory' or a redis:// / rediss:// URL")
