"""The real operator run by kopf against kmock's Kubernetes API emulator (not a cluster)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator.conftest import Harness

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

ISVC = "radixserve.io/v1alpha1/inferenceservices"
POOL = "radixserve.io/v1alpha1/gpunodepools"


def isvc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "radixserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for c in (obj or {}).get("status", {}).get("conditions", []):
        if c["type"] == ctype:
            return c
    return None


async def test_create_makes_children_with_owner_references(harness: Harness) -> None:
    await harness.call(harness.kube.apply, isvc("demo", {"model": {"path": "demo"}, "scheduler": {"device": "cpu", "gpusPerReplica": 0}}))
    dep = await harness.until(lambda: harness.obj("apps/v1/deployments", "default", "demo-gateway"), what="gateway")
    owner = dep["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "InferenceService" and owner["name"] == "demo" and owner["uid"].startswith("uid-")
    sts = harness.obj("apps/v1/statefulsets", "default", "demo-scheduler")
    assert sts is not None
    print(harness.obj(ISVC, "default", "demo"))
