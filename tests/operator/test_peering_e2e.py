"""Two operator replicas with kopf peering against kmock's emulator: one serves, the other stands by
and takes over the services when the first stops (the chart runs two, python -m radixserve.operator
--peering)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest

from radixserve.operator.kube import Kube
from radixserve.operator.scaling import StaticLoadSource
from tests.operator.emulator import _by_operator, access, chart_rbac, running_operator, serving_emulator
from tests.operator.objects import CPU, ISVC, isvc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]

PEERING = "kopf.dev/v1/clusterkopfpeerings"
LIFETIME_S = 3  # a silent peer counts as alive this long (the chart's default is 30)


@contextlib.asynccontextmanager
async def replica(agent: str, priority: int) -> AsyncIterator[None]:
    """One operator replica (its requests tell themselves apart by ``agent``) until the block ends."""
    settings = kopf.OperatorSettings()
    settings.peering.lifetime = LIFETIME_S
    settings.peering.mandatory = True
    memo = kopf.Memo(kube=Kube(user_agent=agent), load_source=lambda url, prefix: StaticLoadSource())
    async with running_operator(
        settings, memo, clusterwide=True, peering_name="radixserve", priority=priority
    ):
        yield


def children_applied_by(emulator: Any, service: str) -> set[str]:
    """User agents of the requests that wrote ``service``'s StatefulSet (every write, a create too,
    starts as a server-side apply to its own path)."""
    return {
        r.headers.get("User-Agent", "")
        for r in emulator._requests
        if f"/statefulsets/{service}-scheduler" in r.url.path and _by_operator(r)
    }


async def until(check: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (result := check()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)
    return result


async def test_one_replica_serves_and_the_other_takes_over_when_it_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import radixserve.operator.handlers  # noqa: F401  (registers with kopf's default registry)

    async with serving_emulator(tmp_path, monkeypatch) as (emulator, _):
        emulator.resources[PEERING] = kmock.ResourceInfo(
            kind="ClusterKopfPeering", namespaced=False, verbs=["list", "watch", "get", "patch", "create"]
        )
        kube = Kube(user_agent="radixserve-tests")
        peering = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": "radixserve"},
        }
        await asyncio.to_thread(kube.create, peering)

        def stored(name: str) -> Any:
            try:
                obj = emulator.objects[ISVC, "default", name]
            except KeyError:
                return None
            return None if obj.deleted else dict(obj.raw)

        def peers() -> dict[str, Any]:
            try:
                obj = emulator.objects[PEERING, None, "radixserve"]
            except KeyError:
                return {}
            return dict(obj.raw.get("status") or {})

        standby = replica("radixserve-operator-standby", priority=100)
        async with standby:
            async with replica("radixserve-operator-active", priority=200):
                # both have written their heartbeat; a second more for the standby to read the
                # active one's and pause (a fixed second alone was short on a loaded machine)
                await until(lambda: len(peers()) == 2, "both replicas' heartbeats")
                await asyncio.sleep(1.0)
                await asyncio.to_thread(kube.apply, isvc("one", scheduler=CPU, redis={"mode": "none"}))
                await until(lambda: (stored("one") or {}).get("status", {}).get("endpoint"), "one's status")
                await asyncio.sleep(2.0)  # a few resync rounds: all of them the active replica's
                assert children_applied_by(emulator, "one") == {"radixserve-operator-active"}
            # The active replica stopped (its peering entry removed on the way out): the standby
            # resumes and reconciles the services it finds.
            await until(
                lambda: "radixserve-operator-standby" in children_applied_by(emulator, "one"),
                "the standby to take over",
            )

        # Every request either replica made is one the chart's ClusterRole allows (peering included).
        used = {a for r in emulator._requests if _by_operator(r) and (a := access(r)) is not None}
        assert ("kopf.dev", "clusterkopfpeerings", "patch") in used
        assert used <= chart_rbac(), f"the chart's ClusterRole misses {sorted(used - chart_rbac())}"
