"""One Redis user and one key prefix per InferenceService on the chart's Redis (Redis ACLs).

    InferenceService NS/NAME, redis.mode chart
      key prefix   rs:NS/NAME:        RADIXSERVE_INDEX_KEY_PREFIX of every pod of the service
      Redis user   rs-NS.NAME         its keys and channels only (``~rs:NS/NAME:*``), and only the
                                      commands the prefix index sends (prefix_index.acl_rules)
      Secret       NAME-redis-HASH    username, password, url (redis://USER:PW@host:6379/0): every
                                      pod's RADIXSERVE_PREFIX_INDEX, by secretKeyRef

The user name joins namespace and name with a dot: a namespace (a DNS label) has none, so no two
services share a user (``rs-a-b-c`` would be both a-b/c and a/b-c).

The password is derived, not drawn: HMAC-SHA256 keyed with the admin password over "NS/NAME".
Every reconcile computes the same one (no rotation per round, none after an operator restart), so
the operator never reads a Secret back and its ClusterRole grants only ``create`` on Secrets (no
get, list, watch, patch: a patch's answer would show any Secret's data). The Secret is immutable
and its name carries a hash of its contents, so a new Redis address or admin password makes a new
Secret, and the pods roll to it (their template names it); the old one goes with the
InferenceService (owner reference, garbage collection).

Redis keeps no users across a restart (nor any data: the chart's Redis has no persistence), so the
operator sets each service's user on every reconcile (``ACL SETUSER`` is idempotent and leaves the
user's connections open); a restarted Redis has its users back within one resync interval.
Deleting a service deletes its user (``ACL DELUSER`` also closes its connections) and its keys.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit, urlunsplit

from radixserve.operator.objects import Obj

if TYPE_CHECKING:
    import redis

SCAN_BATCH = 500  # keys per SCAN step and per UNLINK when a service's keys are deleted
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def key_prefix(namespace: str, name: str) -> str:
    """The prefix of every Redis key InferenceService ``namespace/name`` uses (chart or external Redis)."""
    return f"rs:{namespace}/{name}:"


def user_name(namespace: str, name: str) -> str:
    return f"rs-{namespace}.{name}"


def service_password(admin_password: str, namespace: str, name: str) -> str:
    """The service's Redis password: 256 bits, the same on every call, unknowable without the admin's."""
    message = f"radixserve redis user {namespace}/{name}".encode()
    return hmac.new(admin_password.encode(), message, hashlib.sha256).hexdigest()


def with_credentials(url: str, user: str, password: str) -> str:
    """``url`` with ``user:password@`` in place of whatever credentials it had."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True, slots=True)
class ChartRedis:
    """The chart's Redis as the operator reaches it: ``url`` carries no credentials; ``admin_*``
    are the admin user's (from the chart's Secret, through the operator's environment)."""

    url: str
    admin_user: str
    admin_password: str

    @property
    def admin_url(self) -> str:
        return with_credentials(self.url, self.admin_user, self.admin_password)

    def service_credentials(self, namespace: str, name: str) -> tuple[str, str, str]:
        """(user, password, url) of InferenceService ``namespace/name``."""
        user = user_name(namespace, name)
        password = service_password(self.admin_password, namespace, name)
        return user, password, with_credentials(self.url, user, password)


def credentials_secret(chart: ChartRedis, namespace: str, name: str, labels: dict[str, str]) -> Obj:
    """The service's immutable credentials Secret (name: ``NAME-redis-`` + a hash of its contents)."""
    user, password, url = chart.service_credentials(namespace, name)
    digest = hashlib.sha256(url.encode()).hexdigest()[:10]
    values = {"username": user, "password": password, "url": url}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-redis-{digest}", "namespace": namespace, "labels": labels},
        "type": "Opaque",
        "immutable": True,
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()},
    }


@functools.lru_cache(maxsize=8)
def admin_client(url: str) -> redis.Redis:
    """A client for ``url`` (the admin's), shared by the handlers' threads (redis-py pools connections)."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0, decode_responses=True)


def ensure_user(admin: redis.Redis, user: str, password: str, prefix: str) -> None:
    """Create or reset ``user``: this password only, and the prefix index's rules for ``prefix``."""
    from radixserve.common import prefix_index

    digest = hashlib.sha256(password.encode()).hexdigest()  # the hash: no plain password on the wire
    rules = prefix_index.acl_rules(prefix)
    admin.execute_command("ACL", "SETUSER", user, "resetpass", f"#{digest}", "clearselectors", *rules)


def _batches(keys: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for key in keys:
        batch.append(key)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def delete_keys(client: redis.Redis, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN, then UNLINK in batches); returns how many went."""
    pattern = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
    gone = 0
    for batch in _batches(client.scan_iter(match=pattern, count=SCAN_BATCH), SCAN_BATCH):
        gone += int(client.unlink(*batch))
    return gone


def delete_user(admin: redis.Redis, user: str) -> bool:
    """Delete ``user``, closing its connections; whether it existed."""
    return int(admin.execute_command("ACL", "DELUSER", user)) > 0


def drop_user(admin: redis.Redis, user: str, prefix: str) -> tuple[bool, int]:
    """Delete ``user`` and then its keys: (whether it existed, keys deleted)."""
    existed = delete_user(admin, user)
    return existed, delete_keys(admin, prefix)
