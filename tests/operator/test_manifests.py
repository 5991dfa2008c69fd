"""Manifest builders: a spec in, the exact child objects out (pure functions, no API)."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.common.config import env_var
from radixserve.common.service_config import SchedulerPodConfig
from radixserve.operator.manifests import build_all, config_map, scheduler_statefulset
from tests.operator.specs import POOL, SPEC, ctx


def labels(component: str, managed: bool = True) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "radixserve",
        "app.kubernetes.io/instance": "llm",
        "app.kubernetes.io/component": component,
    }
    if managed:
        out["app.kubernetes.io/managed-by"] = "radixserve-operator"
    return out


def meta(name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": "prod", "labels": labels(component)}


POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}
MOUNTS = [
    {"name": "cache", "mountPath": "/cache"},
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "model", "mountPath": "/models", "readOnly": True},
]
VOLUMES = [
    {"name": "cache", "emptyDir": {}},
    {"name": "tmp", "emptyDir": {}},
    {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
]


def common_env(component: str) -> list[dict[str, Any]]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "OTEL_SERVICE_NAME", "value": f"radixserve-{component}"},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "k8s.pod.name=$(POD_NAME),k8s.namespace.name=prod"},
    ]


def pod_annotations(config_hash: str, metrics_port: int) -> dict[str, str]:
    return {
        "radixserve.io/config-hash": config_hash,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(metrics_port),
        "prometheus.io/path": "/metrics",
    }


def grpc_probes(port: int, startup: int, liveness: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": startup},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"grpc": liveness or {"port": port}, "periodSeconds": 10, "failureThreshold": 6},
    }


def test_config_map_holds_the_engine_settings_as_radixserve_variables() -> None:
    assert config_map(ctx()) == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("llm-engine", "config"),
        "data": {
            "FLASHINFER_WORKSPACE_BASE": "/cache/compiled",
            "HOME": "/cache",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4317",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.1",
            "RADIXSERVE_BLOCK_SIZE": "16",
            "RADIXSERVE_CACHE_DIR": "/cache/radixserve",
            "RADIXSERVE_DISABLE_OVERLAP": "false",
            "RADIXSERVE_DRAIN_TIMEOUT": "30",
            "RADIXSERVE_HOST": "0.0.0.0",
            "RADIXSERVE_INDEX_KEY_PREFIX": "rs:prod/llm:",  # its own: its Redis user may touch no other
            "RADIXSERVE_MODEL": "/models/llama-8b",
            "RADIXSERVE_PAGE_SIZE": "16",
            "RADIXSERVE_ROUTER": "cache-aware",
            "TORCHINDUCTOR_CACHE_DIR": "/cache/compiled/inductor",  # compiled kernels: the pod's cache
            "TRITON_CACHE_DIR": "/cache/compiled/triton",
        },
    }


def test_model_quantization_is_the_schedulers_quantization_setting() -> None:
    """spec.model.quantization fp8: every pod reads RADIXSERVE_QUANTIZATION (the schedulers act on it,
    the others ignore it); unset, the variable is not there (the scheduler's default: none)."""
    fp8 = {**SPEC, "model": {**SPEC["model"], "quantization": "fp8"}}
    assert config_map(ctx(fp8))["data"]["RADIXSERVE_QUANTIZATION"] == "fp8"
    assert "RADIXSERVE_QUANTIZATION" not in config_map(ctx())["data"]
    assert env_var(SchedulerPodConfig, "quantization") == "RADIXSERVE_QUANTIZATION"


def test_services_gateway_two_ports_scheduler_headless_detokenizer_and_named_metrics_ports() -> None:
    services = {o["metadata"]["name"]: o for o in build_all(ctx()) if o["kind"] == "Service"}
    grpc = {"protocol": "TCP", "appProtocol": "grpc", "targetPort": "grpc", "name": "grpc"}
    # What a ServiceMonitor selects: port name "metrics" (the gateway's /metrics is on "http").
    metrics = {"protocol": "TCP", "appProtocol": "http", "targetPort": "metrics", "name": "metrics"}
    assert services == {
        "llm-gateway": {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta("llm-gateway", "gateway"),
            "spec": {
                "selector": labels("gateway", managed=False),
                "ports": [
                    {
                        "name": "http",
                        "port": 8000,
                        "targetPort": "http",
                        "protocol": "TCP",
                        "appProtocol": "http",
                    },
                    {**grpc, "port": 50050},
                ],
                "type": "ClusterIP",
            },
        },
        "llm-scheduler": {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta("llm-scheduler", "scheduler"),
            "spec": {
                "selector": labels("scheduler", managed=False),
                "ports": [{**grpc, "port": 50051}, {**metrics, "port": 9400}],
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
            },
        },
        "llm-detokenizer": {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta("llm-detokenizer", "detokenizer"),
            "spec": {
                "selector": labels("detokenizer", managed=False),
                "ports": [{**grpc, "port": 50052}, {**metrics, "port": 9401}],
                "type": "ClusterIP",
            },
        },
    }


def test_scheduler_statefulset_lands_on_the_pool_with_gpus_and_stable_addresses() -> None:
    c = ctx()
    sts = scheduler_statefulset(c)
    config_hash = sts["spec"]["template"]["metadata"]["annotations"]["radixserve.io/config-hash"]
    assert len(config_hash) == 16
    assert sts == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta("llm-scheduler", "scheduler"),
        "spec": {
            "serviceName": "llm-scheduler",
            "replicas": 2,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels("scheduler", managed=False)},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {
                    # the pool's name: how the GPUNodePool counts the GPUs its schedulers request
                    "labels": {**labels("scheduler"), "radixserve.io/gpu-node-pool": "h100"},
                    "annotations": pod_annotations(config_hash, 9400),
                },
                "spec": {
                    "securityContext": POD_SECURITY,
                    "terminationGracePeriodSeconds": 45,
                    "containers": [
                        {
                            "name": "scheduler",
                            "image": "img:1",
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["python", "-m", "radixserve.scheduler"],
                            "envFrom": [{"configMapRef": {"name": "llm-engine"}}],
                            "env": [
                                *common_env("scheduler"),
                                {"name": "RADIXSERVE_PORT", "value": "50051"},
                                {"name": "RADIXSERVE_METRICS_PORT", "value": "9400"},
                                {
                                    "name": "RADIXSERVE_ADVERTISE_ADDRESS",
                                    "value": "$(POD_NAME).llm-scheduler.prod.svc:50051",
                                },
                                {"name": "RADIXSERVE_DETOKENIZER", "value": "llm-detokenizer.prod.svc:50052"},
                                {"name": "RADIXSERVE_DEVICE", "value": "cuda"},
                                {"name": "RADIXSERVE_PREFIX_INDEX", "value": "redis://r:6379/0"},
                            ],
                            "ports": [
                                {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
                                {"name": "metrics", "containerPort": 9400, "protocol": "TCP"},
                            ],
                            **grpc_probes(50051, 180, {"port": 50051, "service": "liveness"}),
                            "resources": {
                                "requests": {"cpu": "4", "memory": "16Gi"},
                                "limits": {"nvidia.com/gpu": 1},
                            },
                            "volumeMounts": MOUNTS,
                            "securityContext": CONTAINER_SECURITY,
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                        }
                    ],
                    "volumes": VOLUMES,
                    # the pool's own labels: nodes a cluster autoscaler would add carry them too
                    "nodeSelector": {"gpu": "h100"},
                    "tolerations": [
                        {
                            "key": "radixserve.io/inference",
                            "operator": "Equal",
                            "value": "true",
                            "effect": "NoSchedule",
                        }
                    ],
                },
            },
        },
    }


def _scheduler_pod(spec: dict[str, Any], pool: dict[str, Any] | None = POOL) -> dict[str, Any]:
    return scheduler_statefulset(ctx(spec, pool=pool))["spec"]["template"]["spec"]


def test_several_gpus_per_scheduler_split_the_model_with_tensor_parallelism() -> None:
    spec = {**SPEC, "scheduler": {**SPEC["scheduler"], "gpusPerReplica": 2}}
    pod = _scheduler_pod(spec)
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RADIXSERVE_TP_SIZE"] == "2"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}
    # NCCL between the pod's GPUs needs more than the runtime's 64 MiB /dev/shm.
    assert pod["volumes"] == [
        *VOLUMES,
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
    ]
    assert container["volumeMounts"] == [*MOUNTS, {"name": "dshm", "mountPath": "/dev/shm"}]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # A pool naming another GPU resource gets the same count of it.
    other = _scheduler_pod(spec, pool={**POOL, "gpuResourceName": "nvidia.com/mig-7g.80gb"})
    assert other["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-7g.80gb": 2}
    # The model's init container (a hub download) does not get the scheduler's /dev/shm.
    hub = {**spec, "model": {"source": {"hub": {"id": "org/m"}}}}
    hub_pod = _scheduler_pod(hub)
    assert {"name": "dshm", "mountPath": "/dev/shm"} in hub_pod["containers"][0]["volumeMounts"]
    assert all(m["name"] != "dshm" for m in hub_pod["initContainers"][0]["volumeMounts"])


@pytest.mark.parametrize("scheduler", [{"gpusPerReplica": 1}, {"device": "cpu", "gpusPerReplica": 0}])
def test_one_gpu_or_none_runs_without_tensor_parallelism(scheduler: dict[str, Any]) -> None:
    spec = {**SPEC, "scheduler": {**SPEC["scheduler"], **scheduler}}
    pod = _scheduler_pod(spec)
    (container,) = pod["containers"]
    assert "RADIXSERVE_TP_SIZE" not in {e["name"] for e in container["env"]}
    assert pod["volumes"] == VOLUMES and container["volumeMounts"] == MOUNTS
    limits = container["resources"].get("limits", {})
    assert limits == ({"nvidia.com/gpu": 1} if scheduler["gpusPerReplica"] else {})


def test_gateway_deployment_discovers_schedulers_in_redis_and_advertises_its_pod_ip() -> None:
    gw = next(
        o for o in build_all(ctx()) if o["metadata"]["name"] == "llm-gateway" and o["kind"] == "Deployment"
    )
    config_hash = gw["spec"]["template"]["metadata"]["annotations"]["radixserve.io/config-hash"]
    http = {"httpGet": {"path": "/health", "port": 8000}}
    assert gw == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta("llm-gateway", "gateway"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels("gateway", managed=False)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": labels("gateway"),
                    "annotations": pod_annotations(config_hash, 8000),
                },
                "spec": {
                    "securityContext": POD_SECURITY,
                    "terminationGracePeriodSeconds": 45,
                    "containers": [
                        {
                            "name": "gateway",
                            "image": "img:1",
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["python", "-m", "radixserve.tokenizer"],
                            "envFrom": [{"configMapRef": {"name": "llm-engine"}}],
                            "env": [
                                *common_env("gateway"),
                                {"name": "RADIXSERVE_PORT", "value": "8000"},
                                {"name": "RADIXSERVE_GRPC_PORT", "value": "50050"},
                                {"name": "RADIXSERVE_ADVERTISE_ADDRESS", "value": "$(POD_IP):50050"},
                                {"name": "RADIXSERVE_SCHEDULERS", "value": "discover"},
                                {"name": "RADIXSERVE_PREFIX_INDEX", "value": "redis://r:6379/0"},
                            ],
                            "ports": [
                                {"name": "http", "containerPort": 8000, "protocol": "TCP"},
                                {"name": "grpc", "containerPort": 50050, "protocol": "TCP"},
                            ],
                            "startupProbe": {**http, "periodSeconds": 10, "failureThreshold": 90},
                            "readinessProbe": {**http, "periodSeconds": 5, "failureThreshold": 2},
                            "livenessProbe": {**http, "periodSeconds": 10, "failureThreshold": 6},
                            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
                            "volumeMounts": MOUNTS,
                            "securityContext": CONTAINER_SECURITY,
                        }
                    ],
                    "volumes": VOLUMES,
                },
            },
        },
    }


def test_detokenizer_deployment_serves_grpc_health() -> None:
    det = next(
        o
        for o in build_all(ctx())
        if o["metadata"]["name"] == "llm-detokenizer" and o["kind"] == "Deployment"
    )
    (container,) = det["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "radixserve.detokenizer"]
    assert container["env"] == [
        *common_env("detokenizer"),
        {"name": "RADIXSERVE_PORT", "value": "50052"},
        {"name": "RADIXSERVE_METRICS_PORT", "value": "9401"},
    ]
    assert det["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9401"
    assert {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")} == grpc_probes(
        50052, 90
    )
    assert det["spec"]["replicas"] == 1 and "nodeSelector" not in det["spec"]["template"]["spec"]


def test_settings_change_changes_every_pod_template_hash() -> None:
    before = {o["metadata"]["name"]: o for o in build_all(ctx()) if "template" in o.get("spec", {})}
    changed = {**SPEC, "scheduler": {**SPEC["scheduler"], "engine": {"pageSize": 32}}}
    after = {o["metadata"]["name"]: o for o in build_all(ctx(changed)) if "template" in o.get("spec", {})}
    key = "radixserve.io/config-hash"
    for name in before:
        assert (
            before[name]["spec"]["template"]["metadata"]["annotations"][key]
            != (after[name]["spec"]["template"]["metadata"]["annotations"][key])
        )


def test_a_cpu_scheduler_off_any_pool_asks_for_no_gpu_and_selects_no_node() -> None:
    # (How the model's init container downloads it: tests/operator/test_model_storage.py.)
    spec = {
        "model": {"source": {"hub": {"id": "org/m", "tokenSecretRef": {"name": "hf"}}}},
        "scheduler": {"device": "cpu", "gpusPerReplica": 0},
    }
    sts = scheduler_statefulset(ctx(spec, pool=None))
    pod = sts["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model"]
    assert "limits" not in pod["containers"][0]["resources"] and "nodeSelector" not in pod
    assert (
        "tolerations" not in pod
        and "radixserve.io/gpu-node-pool" not in sts["spec"]["template"]["metadata"]["labels"]
    )


def test_external_redis_comes_from_the_secret_and_none_means_an_in_memory_index() -> None:
    ext = {**SPEC, "redis": {"mode": "external", "urlSecretRef": {"name": "redis-url"}}}
    gw = next(
        o for o in build_all(ctx(ext)) if o["kind"] == "Deployment" and "gateway" in o["metadata"]["name"]
    )
    env = {
        e["name"]: e.get("value", e.get("valueFrom"))
        for e in gw["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["RADIXSERVE_PREFIX_INDEX"] == {"secretKeyRef": {"name": "redis-url", "key": "url"}}
    none = {**SPEC, "redis": {"mode": "none"}}
    objs = build_all(ctx(none))
    gw = next(o for o in objs if o["kind"] == "Deployment" and "gateway" in o["metadata"]["name"])
    env = {e["name"]: e.get("value") for e in gw["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RADIXSERVE_PREFIX_INDEX"] == "memory"
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    assert "RADIXSERVE_PREFIX_INDEX" not in {
        e["name"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
    }


@pytest.mark.parametrize("version", ["1.28.0", "1.37.0"])
def test_every_built_object_is_valid_kubernetes(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    hub = {"model": {"source": {"hub": {"id": "org/m"}}}, "scheduler": {"device": "cpu", "gpusPerReplica": 0}}
    tp = {**SPEC, "scheduler": {**SPEC["scheduler"], "gpusPerReplica": 4}}
    for c in (ctx(), ctx(hub, pool=None), ctx(tp)):
        for obj in build_all(c):
            kv.validate(obj, version, strict=True)
