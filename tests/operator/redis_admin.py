"""A real redis-server set up as the chart sets its Redis: an admin user, the default user off.

with chart_like_redis() as (server, chart):   # chart: a ChartRedis with the admin's credentials
    redis_acl.admin_client(chart.admin_url)
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import redis

from radixserve.operator.redis_acl import ChartRedis
from tests.redis_server import RedisServer


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)


def lock_down(server: RedisServer, admin_user: str, admin_password: str) -> None:
    """As the chart's users.acl: ``admin_user`` may do anything, the default user nothing."""
    with client(server.url) as default:  # the server's password: the default user's, for now
        default.execute_command("ACL", "SETUSER", admin_user, "on", f">{admin_password}", "~*", "&*", "+@all")
    with client(f"redis://{admin_user}:{admin_password}@{server.host}:{server.port}/0") as admin:
        admin.execute_command(
            "ACL", "SETUSER", "default", "off", "resetpass", "resetkeys", "resetchannels", "-@all"
        )


@contextlib.contextmanager
def chart_like_redis() -> Iterator[tuple[RedisServer, ChartRedis]]:
    admin_password = secrets.token_hex(16)
    with RedisServer(password=secrets.token_hex(16)) as server:
        lock_down(server, "admin", admin_password)
        yield server, ChartRedis(f"redis://{server.host}:{server.port}/0", "admin", admin_password)
