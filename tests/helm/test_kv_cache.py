"""The chart's InferenceService with spec.scheduler.kvCache, rendered by the real helm binary: valid
against the CRD the chart ships, and the scheduler pods the operator builds from it valid Kubernetes
objects with the host tier's memory and the disk tier's volume; broken kvCache values refused by that
CRD's schema, naming the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from radixserve.operator.crds import INFERENCE_SERVICE_SPEC
from radixserve.operator.manifests import BuildContext, build_all
from radixserve.operator.schema import apply_defaults
from tests.helm.chart import Doc, crd_schemas, one, render, validate_all

CREATE = ["--set", "inferenceService.create=true"]
RESOURCES = {"requests": {"cpu": "8", "memory": "40Gi"}, "limits": {"memory": "48Gi"}}


def _render(env: dict[str, str], kv: dict[str, Any]) -> list[Doc]:
    scheduler = {"kvCache": kv, "resources": RESOURCES}
    return render(env, *CREATE, "--set-json", f"inferenceService.spec.scheduler={json.dumps(scheduler)}")


def _operator_objects(isvc: Doc) -> list[Doc]:
    """What the operator builds from the rendered InferenceService (its spec defaulted as the API
    server would)."""
    spec = apply_defaults(INFERENCE_SERVICE_SPEC, isvc["spec"])
    ctx = BuildContext(
        name=isvc["metadata"]["name"],
        namespace=isvc["metadata"]["namespace"],
        spec=spec,
        image=spec["image"],
        scheduler_replicas=2,
        chart_redis_url="redis://rs-radixserve-redis.serving.svc:6379/0",
    )
    return build_all(ctx)


@pytest.mark.parametrize(
    ("disk", "volume"),
    [
        ({"emptyDir": {}}, {"emptyDir": {"sizeLimit": "300Gi"}}),
        ({"hostPath": "/mnt/nvme/kv"}, {"hostPath": {"path": "/mnt/nvme/kv", "type": "Directory"}}),
        ({"persistentVolumeClaim": {"claimName": "kv"}}, {"persistentVolumeClaim": {"claimName": "kv"}}),
    ],
    ids=["emptyDir", "hostPath", "pvc"],
)
def test_kv_cache_values_render_a_valid_service_whose_schedulers_get_memory_and_the_disk(
    helm_env: dict[str, str], disk: dict[str, Any], volume: dict[str, Any]
) -> None:
    kv = {"hostGiB": 16, "writePolicy": "write_through", "disk": {"sizeGiB": 300, **disk}}
    docs = _render(helm_env, kv)
    validate_all(docs)  # the InferenceService against the CRD the chart ships
    isvc = one(docs, "InferenceService", "llm")
    assert isvc["spec"]["scheduler"]["kvCache"] == kv  # as given: the chart passes spec through
    children = _operator_objects(isvc)
    validate_all(children)  # every object the operator makes of it, against Kubernetes' schemas
    pod = one(children, "StatefulSet", "llm-scheduler")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    grown = {"requests": {"cpu": "8", "memory": "56Gi"}, "limits": {"memory": "64Gi", "nvidia.com/gpu": 1}}
    assert container["resources"] == grown
    assert {"name": "kv-disk", **volume} in pod["volumes"]
    assert {"name": "kv-disk", "mountPath": "/kv-cache"} in container["volumeMounts"]
    data = one(children, "ConfigMap", "llm-engine")["data"]
    assert (
        data["RADIXSERVE_HOST_KV_CACHE_GB"] == "16" and data["RADIXSERVE_KV_WRITE_POLICY"] == "write_through"
    )
    assert (data["RADIXSERVE_KV_DISK_CACHE_DIR"], data["RADIXSERVE_KV_DISK_CACHE_GB"]) == ("/kv-cache", "300")


def test_without_kv_cache_the_schedulers_get_no_tier(helm_env: dict[str, str]) -> None:
    children = _operator_objects(one(render(helm_env, *CREATE), "InferenceService", "llm"))
    pod = one(children, "StatefulSet", "llm-scheduler")["spec"]["template"]["spec"]
    assert all(v["name"] != "kv-disk" for v in pod["volumes"])
    resources = pod["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": 1}}
    data = one(children, "ConfigMap", "llm-engine")["data"]
    assert not [k for k in data if "KV_CACHE" in k or "KV_DISK" in k or "KV_WRITE" in k]


@pytest.mark.parametrize(
    ("kv", "field"),
    [
        ({"hostGiB": -8}, "hostGiB"),
        ({"hostGiB": 8, "writePolicy": "lazy"}, "writePolicy"),
        ({"hostGiB": 8, "disk": {"sizeGiB": -1, "emptyDir": {}}}, "sizeGiB"),
        ({"hostGiB": 8, "disk": {"emptyDir": {}}}, "sizeGiB"),
        ({"hostGiB": 8, "disk": {"sizeGiB": 5, "persistentVolumeClaim": {"claimName": ""}}}, "claimName"),
    ],
    ids=["negative-host", "policy", "negative-disk", "no-size", "empty-claim"],
)
def test_broken_kv_cache_values_are_refused_by_the_shipped_crd_naming_the_field(
    helm_env: dict[str, str], kv: dict[str, Any], field: str
) -> None:
    isvc = one(_render(helm_env, kv), "InferenceService", "llm")
    validator = jsonschema.Draft4Validator(crd_schemas()["InferenceService"])
    errors = list(validator.iter_errors(isvc))
    assert errors and all(field in e.json_path or field in e.message for e in errors), [
        (e.json_path, e.message) for e in errors
    ]
