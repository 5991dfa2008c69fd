"""The chart's pre-delete hook (operator/uninstall.py) against the running operator in kmock's
emulator: every InferenceService and GPUNodePool is deleted and released before the operator goes,
so nothing is left holding a finalizer nobody will remove."""

from __future__ import annotations

import pytest

from radixserve.operator import uninstall
from tests.operator import emulator
from tests.operator.emulator import Harness
from tests.operator.objects import CPU, ISVC, POOL, isvc

harness = emulator.harness  # the fixture: kopf running our handlers against a fresh emulator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

SERVICES = [("a", "default"), ("b", "default"), ("c", "team")]
POOL_BODY = {
    "apiVersion": "radixserve.io/v1alpha1",
    "kind": "GPUNodePool",
    "metadata": {"name": "h100"},
    "spec": {"nodeSelector": {"gpu": "h100"}},
}


async def test_the_hook_deletes_every_service_and_pool_and_waits_for_their_finalizers(
    harness: Harness,
) -> None:
    await harness.call(harness.kube.apply, POOL_BODY)
    for name, ns in SERVICES:
        body = isvc(name, scheduler=CPU, redis={"mode": "none"})
        body["metadata"]["namespace"] = ns
        await harness.call(harness.kube.apply, body)
    for name, ns in SERVICES:
        # Held by the operator's finalizer, as on a cluster (deleted without the operator: stuck).
        await harness.until(
            lambda n=name, s=ns: (
                harness.obj(ISVC, s, n)["status"]["endpoint"]  # type: ignore[misc]
                and harness.obj(ISVC, s, n)["metadata"]["finalizers"]
            ),
            what=f"{name}'s status and finalizer",
        )
    await harness.until(lambda: harness.obj(POOL, None, "h100")["metadata"]["finalizers"], what="pool")

    left = await harness.call(uninstall.delete_all, harness.kube, [], 30.0, 0.1)

    assert left == []
    assert all(
        harness.obj(ISVC, s, n) is None for n, s in [("a", "default"), ("b", "default"), ("c", "team")]
    )
    assert harness.obj(POOL, None, "h100") is None


async def test_with_watched_namespaces_it_leaves_other_namespaces_alone(harness: Harness) -> None:
    await harness.call(harness.kube.apply, POOL_BODY)  # another release's pool, maybe
    await harness.until(lambda: harness.obj(POOL, None, "h100")["metadata"]["finalizers"], what="pool")
    for ns in ("ml", "elsewhere"):
        body = isvc("svc", scheduler=CPU, redis={"mode": "none"})
        body["metadata"]["namespace"] = ns
        await harness.call(harness.kube.apply, body)
        await harness.until(lambda s=ns: harness.obj(ISVC, s, "svc")["status"]["endpoint"], what=ns)

    left = await harness.call(uninstall.delete_all, harness.kube, ["ml"], 30.0, 0.1, [])

    assert left == []
    assert harness.obj(ISVC, "ml", "svc") is None
    assert harness.obj(ISVC, "elsewhere", "svc") is not None  # another operator's, or nobody's
    assert harness.obj(POOL, None, "h100") is not None  # the chart's own pools only (none here)


async def test_what_the_operator_does_not_release_in_time_is_named(harness: Harness) -> None:
    # A finalizer that is not the operator's (another controller's, or one left by a crashed
    # operator of another release): the hook gives up at its deadline and says which object.
    body = isvc("held", scheduler=CPU, redis={"mode": "none"})
    body["metadata"]["finalizers"] = ["example.com/someone-else"]
    await harness.call(harness.kube.apply, body)
    await harness.until(lambda: harness.obj(ISVC, "default", "held")["status"]["endpoint"], what="status")

    left = await harness.call(uninstall.delete_all, harness.kube, [], 1.0, 0.1)

    assert left == ["InferenceService default/held"]


async def test_kinds_the_cluster_no_longer_serves_count_as_gone(harness: Harness) -> None:
    # The CRDs deleted before the uninstall (by hand, or a second uninstall): nothing to wait for.
    del harness.emulator.resources["radixserve.io/v1alpha1/inferenceservices"]
    del harness.emulator.resources["radixserve.io/v1alpha1/gpunodepools"]

    assert await harness.call(uninstall.delete_all, harness.kube, [], 5.0, 0.1) == []
