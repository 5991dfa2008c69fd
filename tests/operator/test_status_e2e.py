"""The operator against kmock's emulator: what the status says about the service's pods (Degraded
with their reason, Events on transitions) and the PodDisruptionBudgets it makes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator import emulator
from tests.operator.emulator import Harness
from tests.operator.objects import CPU, ISVC, cond, degraded_of, isvc, scheduler_pod

harness = emulator.harness  # the fixture: kopf running our handlers against a fresh emulator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def component_pod(service: str, component: str, status: dict[str, Any]) -> dict[str, Any]:
    """A pod of one of the service's components with the given status (no kubelet in the emulator)."""
    pod = scheduler_pod(service, 0, {})
    pod["metadata"]["name"] = f"{service}-{component}-0"
    pod["metadata"]["labels"]["app.kubernetes.io/component"] = component
    pod["status"] = status
    return pod


def events_of(harness: Harness, name: str) -> list[dict[str, Any]]:
    """The Events posted about InferenceService ``name`` (kopf posts them to the core events API)."""
    raws = [dict(o.raw) for o in list(harness.emulator.objects.values()) if not o.deleted]
    return [r for r in raws if (r.get("involvedObject") or {}).get("name") == name]  # only Events have one


async def test_pods_in_trouble_make_the_service_degraded_with_their_reason_and_an_event(
    harness: Harness,
) -> None:
    await harness.call(harness.kube.apply, isvc("pods", scheduler=CPU, redis={"mode": "none"}))
    await harness.until(lambda: harness.obj(ISVC, "default", "pods")["status"]["endpoint"], what="status")
    pull = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "gateway",
                "image": "registry.example/radixserve:nope",
                "ready": False,
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}},
            }
        ],
    }
    await harness.call(harness.kube.apply, component_pod("pods", "tokenizer", pull))
    degraded = await harness.until(
        lambda: (d := degraded_of(harness, "pods")).get("reason") == "ImagePullBackOff" and d,
        what="ImagePullBackOff",
    )
    assert (
        "registry.example/radixserve:nope" in degraded["message"]
        and "pods-tokenizer-0" in degraded["message"]
    )
    assert cond(harness.obj(ISVC, "default", "pods"), "Ready")["reason"] == "ImagePullBackOff"
    warned = await harness.until(
        lambda: [e for e in events_of(harness, "pods") if e.get("reason") == "ImagePullBackOff"],
        what="the event",
    )
    assert warned[0]["type"] == "Warning"

    unplaced = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient memory.",
            }
        ],
    }
    await harness.call(harness.kube.apply, component_pod("pods", "tokenizer", unplaced))
    degraded = await harness.until(
        lambda: (d := degraded_of(harness, "pods")).get("reason") == "Unschedulable" and d,
        what="Unschedulable",
    )
    assert "3 Insufficient memory" in degraded["message"]

    running = {
        "phase": "Running",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [{"name": "gateway", "ready": True, "state": {"running": {}}}],
    }
    await harness.call(harness.kube.apply, component_pod("pods", "tokenizer", running))
    await harness.until(lambda: degraded_of(harness, "pods")["status"] == "False", what="Degraded to clear")
    await harness.until(
        lambda: [e for e in events_of(harness, "pods") if e.get("reason") == "Recovered"],
        what="the recovery event",
    )


async def test_gateways_and_schedulers_get_disruption_budgets(harness: Harness) -> None:
    await harness.call(harness.kube.apply, isvc("pdb", scheduler=CPU, redis={"mode": "none"}))
    pdbs = "policy/v1/poddisruptionbudgets"
    for component in ("gateway", "scheduler"):
        pdb = await harness.until(
            lambda c=component: harness.obj(pdbs, "default", f"pdb-{c}"), what=f"{component} PDB"
        )
        assert pdb["spec"]["maxUnavailable"] == 1
        selected = pdb["spec"]["selector"]["matchLabels"]
        assert (
            selected["app.kubernetes.io/instance"] == "pdb"
            and selected["app.kubernetes.io/component"] == component
        )
        # it selects exactly the pods of that component's workload
        kind = "apps/v1/deployments" if component == "gateway" else "apps/v1/statefulsets"
        workload = harness.obj(kind, "default", f"pdb-{component}")
        assert workload["spec"]["selector"]["matchLabels"] == selected
        assert pdb["metadata"]["ownerReferences"][0]["name"] == "pdb"  # goes with the service
    assert harness.obj(pdbs, "default", "pdb-detokenizer") is None
