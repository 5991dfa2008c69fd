"""The operator against kmock's emulator, day-2 features: users' pod templates on the workloads, names
too long for the children, who owns the scheduler count in each autoscaling mode, schedulers placed
on a GPUNodePool that a cluster autoscaler grows."""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator import emulator
from tests.operator.emulator import Harness
from tests.operator.objects import CPU, DEPLOY, ISVC, POOL, STS, cond, degraded_of, env, isvc

harness = emulator.harness  # the fixture: kopf running our handlers against a fresh emulator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def pod_of(harness: Harness, kind: str, name: str) -> dict[str, Any]:
    return harness.obj(kind, "default", name)["spec"]["template"]


async def test_pod_templates_land_on_the_deployments_and_the_statefulset(harness: Harness) -> None:
    service_template = {
        "metadata": {"labels": {"team": "search"}},
        "spec": {
            "imagePullSecrets": [{"name": "registry"}],
            "priorityClassName": "inference",
            "volumes": [{"name": "redis-ca", "configMap": {"name": "redis-ca"}}],
            "containers": [
                {"name": c, "volumeMounts": [{"name": "redis-ca", "mountPath": "/etc/redis-ca"}]}
                for c in ("gateway", "scheduler", "detokenizer")
            ],
        },
    }
    scheduler_template = {"spec": {"priorityClassName": "gpu-critical", "serviceAccountName": "sched"}}
    spec = {"scheduler": {**CPU, "template": scheduler_template}, "template": service_template}
    await harness.call(harness.kube.apply, isvc("tpl", **spec))
    await harness.until(lambda: harness.obj(DEPLOY, "default", "tpl-gateway"), what="the gateway")
    workloads = {"gateway": DEPLOY, "detokenizer": DEPLOY, "scheduler": STS}
    for component, kind in workloads.items():
        template = pod_of(harness, kind, f"tpl-{component}")
        pod = template["spec"]
        assert template["metadata"]["labels"]["team"] == "search"
        assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "tpl"  # ours stay
        assert pod["imagePullSecrets"] == [{"name": "registry"}]
        assert {"name": "redis-ca", "configMap": {"name": "redis-ca"}} in pod["volumes"]
        (container,) = pod["containers"]
        assert container["volumeMounts"][-1] == {"name": "redis-ca", "mountPath": "/etc/redis-ca"}
        # the component's own template wins over the service's
        want = "gpu-critical" if component == "scheduler" else "inference"
        assert pod["priorityClassName"] == want, component
    assert pod_of(harness, STS, "tpl-scheduler")["spec"]["serviceAccountName"] == "sched"
    assert "serviceAccountName" not in pod_of(harness, DEPLOY, "tpl-gateway")["spec"]


async def test_a_name_the_children_cannot_carry_is_degraded_invalid_name(harness: Harness) -> None:
    long_name = "a" * 43  # its StatefulSet's revision label would be 64 characters
    await harness.call(harness.kube.apply, isvc(long_name, scheduler=CPU))
    await harness.call(harness.kube.apply, isvc("fits-" + "a" * 37, scheduler=CPU))  # 42: fits
    degraded = await harness.until(lambda: degraded_of(harness, long_name), what="the long name's status")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidName")
    assert "at most 42 characters" in degraded["message"]
    assert harness.obj(DEPLOY, "default", f"{long_name}-gateway") is None
    await harness.until(lambda: harness.obj(STS, "default", f"fits-{'a' * 37}-scheduler"), what="42 fits")


def sts_patches(harness: Harness, name: str) -> list[dict[str, Any]]:
    """The bodies of the operator's writes to StatefulSet ``name``."""
    return [
        r.data
        for r in harness.emulator._requests
        if emulator._by_operator(r)
        and r.url.path.endswith(f"/statefulsets/{name}")
        and str(getattr(r.method, "value", r.method)).upper() == "PATCH"
        and isinstance(r.data, dict)
    ]


async def test_external_mode_never_writes_the_scheduler_count(harness: Harness) -> None:
    scheduler = {**CPU, "replicas": 2, "autoscaling": {"mode": "external"}}
    await harness.call(harness.kube.apply, isvc("ext", scheduler=scheduler))
    await harness.until(lambda: harness.obj(STS, "default", "ext-scheduler"), what="the schedulers")
    status = await harness.until(
        lambda: harness.obj(ISVC, "default", "ext")["status"].get("selector"), what="status"
    )
    assert status == (
        "app.kubernetes.io/component=scheduler,app.kubernetes.io/instance=ext,app.kubernetes.io/name=radixserve"
    )
    # An HPA (or KEDA) on the StatefulSet sets its replicas; the operator reports them and leaves them.
    await harness.call(
        harness.kube.merge_patch, "StatefulSet", "default", "ext-scheduler", {"spec": {"replicas": 5}}
    )
    await harness.until(
        lambda: harness.obj(ISVC, "default", "ext")["status"]["schedulerReplicas"] == 5,
        what="the count found",
    )
    await harness.call(
        harness.kube.merge_patch,
        "InferenceService",
        "default",
        "ext",
        {"spec": {"routing": {"blockSize": 32}}},
    )
    await harness.until(
        lambda: (
            harness.obj("v1/configmaps", "default", "ext-engine")["data"]["RADIXSERVE_BLOCK_SIZE"] == "32"
        ),
        what="the settings change applied",
    )
    assert harness.obj(STS, "default", "ext-scheduler")["spec"]["replicas"] == 5
    bodies = sts_patches(harness, "ext-scheduler")
    assert bodies and all("replicas" not in b.get("spec", {}) for b in bodies)
    assert harness.obj(ISVC, "default", "ext")["status"]["replicas"]["scheduler"] == "0/5"
    assert env(harness.obj(DEPLOY, "default", "ext-gateway"))["RADIXSERVE_SCHEDULERS"] == "discover"


async def test_off_mode_follows_the_scale_subresources_count_without_rolling_the_gateway(
    harness: Harness,
) -> None:
    await harness.call(harness.kube.apply, isvc("hpa", scheduler={**CPU, "replicas": 1}))
    gateway = await harness.until(lambda: harness.obj(DEPLOY, "default", "hpa-gateway"), what="the gateway")
    # What an HPA on the InferenceService writes through /scale: spec.scheduler.replicas.
    patch = {"spec": {"scheduler": {"replicas": 3}}}
    await harness.call(harness.kube.merge_patch, "InferenceService", "default", "hpa", patch)
    await harness.until(
        lambda: harness.obj(STS, "default", "hpa-scheduler")["spec"]["replicas"] == 3, what="3"
    )
    await harness.until(
        lambda: harness.obj(ISVC, "default", "hpa")["status"]["schedulerReplicas"] == 3, what="status"
    )
    assert harness.obj(DEPLOY, "default", "hpa-gateway")["spec"]["template"] == gateway["spec"]["template"]


async def test_schedulers_on_a_pool_a_cluster_autoscaler_grows(harness: Harness) -> None:
    # No node exists yet: the pending pods must match the labels Karpenter's nodes will carry.
    pool = {
        "apiVersion": "radixserve.io/v1alpha1",
        "kind": "GPUNodePool",
        "metadata": {"name": "h100"},
        "spec": {
            "nodeSelector": {"karpenter.sh/nodepool": "gpu-h100"},
            "taint": {},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }
    await harness.call(harness.kube.apply, pool)
    await harness.until(lambda: harness.obj(POOL, None, "h100")["status"]["conditions"], what="pool status")
    assert cond(harness.obj(POOL, None, "h100"), "Ready")["reason"] == "NoMatchingNodes"
    await harness.call(harness.kube.apply, isvc("grow", scheduler={"nodePool": "h100", "gpusPerReplica": 2}))
    sts = await harness.until(lambda: harness.obj(STS, "default", "grow-scheduler"), what="the schedulers")
    template = sts["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"karpenter.sh/nodepool": "gpu-h100"}
    assert [t["key"] for t in template["spec"]["tolerations"]] == [
        "radixserve.io/inference",
        "nvidia.com/gpu",
    ]
    assert template["metadata"]["labels"]["radixserve.io/gpu-node-pool"] == "h100"

    # Node counts belong to the provider: a pool that sets them is refused, and so are its users.
    limits = {"spec": {"maxNodes": 4}}
    await harness.call(harness.kube.merge_patch, "GPUNodePool", None, "h100", limits)
    refused = await harness.until(
        lambda: (c := cond(harness.obj(POOL, None, "h100"), "Ready")).get("reason") == "InvalidSpec" and c,
        what="the pool refused",
    )
    assert "Karpenter NodePool spec.limits" in refused["message"]
    degraded = await harness.until(
        lambda: (d := degraded_of(harness, "grow")).get("reason") == "InvalidNodePool" and d,
        what="grow refused",
    )
    assert "maxNodes" in degraded["message"]
