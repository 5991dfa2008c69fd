"""The objects the operator's e2e tests write to the API emulator and read back: resource paths,
InferenceServices, nodes and pods as controllers would make them, and accessors."""

from __future__ import annotations

from typing import Any

from tests.operator.emulator import Harness

ISVC = "radixserve.io/v1alpha1/inferenceservices"


POOL = "radixserve.io/v1alpha1/gpunodepools"


DEPLOY = "apps/v1/deployments"


STS = "apps/v1/statefulsets"


CPU = {"device": "cpu", "gpusPerReplica": 0}


def isvc(name: str, **spec: Any) -> dict[str, Any]:
    spec.setdefault("model", {"path": "demo"})
    return {
        "apiVersion": "radixserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def node(name: str, labels: dict[str, str], gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": [{"key": "other", "value": "x", "effect": "NoSchedule"}]},
        "status": {
            "capacity": {"nvidia.com/gpu": str(gpus)},
            "allocatable": {"nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def cond(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    return next((c for c in (obj or {}).get("status", {}).get("conditions", []) if c["type"] == ctype), {})


def degraded_of(harness: Harness, name: str) -> dict[str, Any]:
    return cond(harness.obj(ISVC, "default", name), "Degraded")


def env(workload: dict[str, Any]) -> dict[str, Any]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def scheduler_pod(service: str, index: int, container_status: dict[str, Any]) -> dict[str, Any]:
    """What the StatefulSet controller and the kubelet would make (no controllers run in the emulator)."""
    labels = {
        "app.kubernetes.io/name": "radixserve",
        "app.kubernetes.io/instance": service,
        "app.kubernetes.io/component": "scheduler",
        "app.kubernetes.io/managed-by": "radixserve-operator",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{service}-scheduler-{index}", "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "scheduler", "image": "radixserve:test"}]},
        "status": {"phase": "Running", "containerStatuses": [container_status]},
    }
