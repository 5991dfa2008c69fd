"""Per-service Redis users against a real redis-server locked down as the chart's (no default user)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from radixserve.common.prefix_index import RedisPrefixIndex
from radixserve.operator import redis_acl
from radixserve.operator.redis_acl import ChartRedis
from tests.operator.redis_admin import chart_like_redis, client
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow  # a redis-server per test

POD_A = "a-scheduler-0.a-scheduler.prod.svc:50051"


@pytest.fixture()
def chart_redis() -> Iterator[tuple[RedisServer, ChartRedis]]:
    with chart_like_redis() as pair:
        yield pair


def provision(chart: ChartRedis, namespace: str, name: str) -> tuple[str, str]:
    """What the operator does for a service: its user; returns (its URL, its key prefix)."""
    user, password, url = chart.service_credentials(namespace, name)
    prefix = redis_acl.key_prefix(namespace, name)
    redis_acl.ensure_user(redis_acl.admin_client(chart.admin_url), user, password, prefix)
    return url, prefix


def test_nobody_gets_in_without_a_user(chart_redis: tuple[RedisServer, ChartRedis]) -> None:
    server, _ = chart_redis
    with pytest.raises(redis.AuthenticationError), client(f"redis://{server.host}:{server.port}/0") as anon:
        anon.ping()


def test_a_service_user_runs_the_index_in_its_prefix_and_nowhere_else(
    chart_redis: tuple[RedisServer, ChartRedis],
) -> None:
    _, chart = chart_redis
    url_a, prefix_a = provision(chart, "prod", "a")
    url_b, prefix_b = provision(chart, "prod", "b")
    index_a = RedisPrefixIndex(url_a, prefix_a, timeout_s=5.0)
    index_a.heartbeat(POD_A, {"waiting": 3}, 5.0)
    index_a.apply(POD_A, [11, 12, 13], [])
    assert index_a.match([11, 12, 13]) == {POD_A: 3}
    assert index_a.live_pods()[POD_A]["waiting"] == 3
    admin = redis_acl.admin_client(chart.admin_url)
    keys_a = set(admin.scan_iter())  # every key in the db
    assert keys_a and all(k.startswith("rs:prod/a:") for k in keys_a)  # nothing outside A's prefix

    # B's credentials: B's prefix works, A's keys can be neither read nor written nor deleted.
    index_b = RedisPrefixIndex(url_b, prefix_b, timeout_s=5.0)
    assert index_b.live_pods() == {}
    with client(url_b) as as_b:
        for key in sorted(keys_a):
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_b.get(key)
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_b.delete(key)
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_b.execute_command("KEYS", "*")  # not a command the index sends
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_b.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_b.execute_command("ACL", "SETUSER", "rs-prod.b", "~*")
    with pytest.raises(redis.exceptions.NoPermissionError):
        RedisPrefixIndex(url_b, prefix_a, timeout_s=5.0).live_pods()  # B posing with A's prefix
    # A wrong password is no way in either.
    password_a = chart.service_credentials("prod", "a")[1]
    with pytest.raises(redis.AuthenticationError), client(url_a.replace(password_a, "0" * 64)) as wrong:
        wrong.ping()


def test_setting_the_user_again_changes_nothing_and_keeps_its_connections(
    chart_redis: tuple[RedisServer, ChartRedis],
) -> None:
    _, chart = chart_redis
    url, prefix = provision(chart, "prod", "a")
    admin = redis_acl.admin_client(chart.admin_url)
    before = admin.execute_command("ACL", "GETUSER", "rs-prod.a")
    with client(url) as as_a:
        as_a.set(f"{prefix}x", "1")
        provision(chart, "prod", "a")  # every reconcile does this
        assert as_a.get(f"{prefix}x") == "1"  # same connection, still in
    assert admin.execute_command("ACL", "GETUSER", "rs-prod.a") == before
    assert before["keys"] == "~rs:prod/a:*" and before["channels"] == "&rs:prod/a:*"
    assert before["flags"][0] == "on" and len(before["passwords"]) == 1


def test_dropping_a_service_takes_its_user_and_keys_and_nothing_else(
    chart_redis: tuple[RedisServer, ChartRedis],
) -> None:
    _, chart = chart_redis
    url_a, prefix_a = provision(chart, "prod", "a")
    url_b, prefix_b = provision(
        chart, "prod", "ab"
    )  # a prefix of a's name: rs:prod/ab: is not under rs:prod/a:
    admin = redis_acl.admin_client(chart.admin_url)
    admin.mset({f"{prefix_a}{i}": "x" for i in range(1200)})  # more than one SCAN / UNLINK batch
    with client(url_b) as as_b:
        as_b.set(f"{prefix_b}kept", "y")
    assert redis_acl.drop_user(admin, "rs-prod.a", prefix_a) == (True, 1200)
    assert admin.execute_command("ACL", "GETUSER", "rs-prod.a") is None
    assert admin.get(f"{prefix_b}kept") == "y" and admin.dbsize() == 1
    with pytest.raises(redis.AuthenticationError), client(url_a) as gone:  # the user went
        gone.ping()
    assert redis_acl.drop_user(admin, "rs-prod.a", prefix_a) == (False, 0)  # idempotent
