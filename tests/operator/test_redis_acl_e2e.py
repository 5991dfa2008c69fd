"""The operator (kopf, kmock's emulator) with a real redis-server locked down as the chart's: one Redis
user and credentials Secret per InferenceService, NetworkPolicies, and nothing left after delete."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

for _module in ("kopf", "kmock", "pytest_asyncio", "kubernetes"):
    pytest.importorskip(_module, reason=f"the operator e2e tests need {_module} (see docs/development.md)")

import redis  # noqa: E402

from radixserve.common.prefix_index import RedisPrefixIndex  # noqa: E402
from radixserve.operator import handlers, redis_acl  # noqa: E402
from radixserve.operator.netpol import PolicySettings  # noqa: E402
from radixserve.operator.redis_acl import ChartRedis  # noqa: E402
from tests.operator import emulator  # noqa: E402
from tests.operator.emulator import Harness  # noqa: E402
from tests.operator.objects import CPU, DEPLOY, ISVC, STS, isvc  # noqa: E402
from tests.operator.redis_admin import chart_like_redis, client  # noqa: E402

harness = emulator.harness

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

SECRETS = "v1/secrets"
POLICIES = "networking.k8s.io/v1/networkpolicies"
REDIS_PEER = {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "redis"}}}


@pytest.fixture()
def chart_redis(monkeypatch: pytest.MonkeyPatch) -> Iterator[ChartRedis]:
    """The operator's settings as the chart gives them: this Redis, its admin, policies on."""
    with chart_like_redis() as (_, chart):
        config = dataclasses.replace(
            handlers.CONFIG,
            chart_redis_url=chart.url,
            redis_admin_user=chart.admin_user,
            redis_admin_password=chart.admin_password,
            policies=PolicySettings(enabled=True, monitoring_namespace="monitoring", redis_peer=REDIS_PEER),
        )
        monkeypatch.setattr(handlers, "CONFIG", config)
        yield chart


def credentials(harness: Harness, name: str) -> dict[str, str]:
    """The data of the service's credentials Secret (the one its gateway's env names)."""
    gateway = harness.obj(DEPLOY, "default", f"{name}-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    ref = next(e for e in container["env"] if e["name"] == "RADIXSERVE_PREFIX_INDEX")["valueFrom"]
    secret = harness.obj(SECRETS, "default", ref["secretKeyRef"]["name"])
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def env_refs(workload: dict[str, Any]) -> dict[str, Any]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("valueFrom") for e in container["env"]}


async def test_each_service_gets_a_user_confined_to_its_prefix_and_loses_it_on_delete(
    chart_redis: ChartRedis, harness: Harness
) -> None:
    admin = redis_acl.admin_client(chart_redis.admin_url)
    for name in ("a", "b"):
        await harness.call(harness.kube.apply, isvc(name, scheduler=CPU))
    for name in ("a", "b"):
        await harness.until(
            lambda n=name: harness.obj(DEPLOY, "default", f"{n}-gateway"), what=f"{name}'s pods"
        )
    await harness.until(
        lambda: admin.execute_command("ACL", "GETUSER", "rs-default.b"), what="b's Redis user"
    )

    creds_a, creds_b = credentials(harness, "a"), credentials(harness, "b")
    assert creds_a["username"] == "rs-default.a" and creds_a["password"] != creds_b["password"]
    assert creds_a["url"] == f"redis://rs-default.a:{creds_a['password']}@{chart_redis.url.split('//')[1]}"
    user = admin.execute_command("ACL", "GETUSER", "rs-default.a")
    assert user["keys"] == "~rs:default/a:*" and user["channels"] == "&rs:default/a:*"
    assert user["commands"].startswith("-@all +")

    # Every pod reads the URL from the Secret; the prefix comes with the config; the Secret is
    # owned by the service (the garbage collector deletes it with it) and immutable.
    secret_name = env_refs(harness.obj(STS, "default", "a-scheduler"))["RADIXSERVE_PREFIX_INDEX"][
        "secretKeyRef"
    ]["name"]
    assert env_refs(harness.obj(DEPLOY, "default", "a-gateway"))["RADIXSERVE_PREFIX_INDEX"]["secretKeyRef"][
        "name"
    ] == (secret_name)
    assert (
        harness.obj("v1/configmaps", "default", "a-engine")["data"]["RADIXSERVE_INDEX_KEY_PREFIX"]
        == "rs:default/a:"
    )
    secret = harness.obj(SECRETS, "default", secret_name)
    assert secret["immutable"] is True
    assert secret["metadata"]["ownerReferences"][0]["name"] == "a"
    for component in ("gateway", "scheduler", "detokenizer"):
        policy = harness.obj(POLICIES, "default", f"a-{component}")
        assert policy["metadata"]["ownerReferences"][0]["name"] == "a"
        assert {"to": [REDIS_PEER], "ports": [{"protocol": "TCP", "port": 6379}]} in policy["spec"]["egress"]

    # A's generated credentials run A's index; they cannot read B's keys, nor B's A's.
    pod_a, pod_b = (
        "a-scheduler-0.a-scheduler.default.svc:50051",
        "b-scheduler-0.b-scheduler.default.svc:50051",
    )
    RedisPrefixIndex(creds_a["url"], "rs:default/a:", timeout_s=5.0).heartbeat(pod_a, {"waiting": 1}, 5.0)
    index_b = RedisPrefixIndex(creds_b["url"], "rs:default/b:", timeout_s=5.0)
    index_b.heartbeat(pod_b, {"waiting": 2}, 5.0)
    index_b.apply(pod_b, [1, 2], [])
    keys_b = sorted(admin.scan_iter(match="rs:default/b:*"))
    assert keys_b
    with client(creds_a["url"]) as as_a:
        for key in keys_b:
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_a.get(key)
    with pytest.raises(redis.exceptions.NoPermissionError):
        RedisPrefixIndex(creds_a["url"], "rs:default/b:", timeout_s=5.0).live_pods()

    # A Redis restart loses its users (no persistence): the resync sets them again.
    admin.execute_command("ACL", "DELUSER", "rs-default.a")
    await harness.until(lambda: admin.execute_command("ACL", "GETUSER", "rs-default.a"), what="a's user back")

    # Delete B: its user and keys go; A's stay.
    await harness.call(harness.kube.delete, "InferenceService", "default", "b")
    await harness.until(lambda: harness.obj(ISVC, "default", "b") is None, what="b to go")
    assert admin.execute_command("ACL", "GETUSER", "rs-default.b") is None
    assert list(admin.scan_iter(match="rs:default/b:*")) == []
    assert list(admin.scan_iter(match="rs:default/a:*"))
    with pytest.raises(redis.AuthenticationError), client(creds_b["url"]) as gone:
        gone.ping()


async def test_leaving_chart_mode_drops_the_user_and_turning_policies_off_drops_them(
    chart_redis: ChartRedis, harness: Harness
) -> None:
    admin = redis_acl.admin_client(chart_redis.admin_url)
    await harness.call(harness.kube.apply, isvc("c", scheduler=CPU))
    await harness.until(
        lambda: admin.execute_command("ACL", "GETUSER", "rs-default.c"), what="c's Redis user"
    )
    await harness.until(lambda: harness.obj(POLICIES, "default", "c-gateway"), what="c's policies")
    change = {"spec": {"redis": {"mode": "none"}, "networkPolicy": {"enabled": False}}}
    await harness.call(harness.kube.merge_patch, "InferenceService", "default", "c", change)
    await harness.until(
        lambda: admin.execute_command("ACL", "GETUSER", "rs-default.c") is None, what="no user"
    )
    await harness.until(lambda: harness.obj(POLICIES, "default", "c-gateway") is None, what="no policies")
    gateway = await harness.until(
        lambda: (
            (g := harness.obj(DEPLOY, "default", "c-gateway"))
            and env_refs(g).get("RADIXSERVE_PREFIX_INDEX") is None
            and g
        ),
        what="an in-memory index",
    )
    env = {e["name"]: e.get("value") for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RADIXSERVE_PREFIX_INDEX"] == "memory"
