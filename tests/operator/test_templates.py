"""Users' pod templates: what reaches the pods the operator makes, in which order, and what stays the
operator's (pure: a spec in, the built objects out)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jsonschema
import pytest

from radixserve.operator import crds
from radixserve.operator.config import POD_DEFAULTS_ENV, OperatorConfig
from radixserve.operator.manifests import build_all
from radixserve.operator.schema import schema_problems
from tests.operator.specs import POOL, SPEC, ctx

CA_VOLUME = {"name": "redis-ca", "configMap": {"name": "redis-ca"}}
SERVICE_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "search"}, "annotations": {"owner": "search@example.com"}},
    "spec": {
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "llm-pods",
        "nodeSelector": {"topology.kubernetes.io/zone": "eu-1a"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "llm"}},
                        },
                    }
                ]
            }
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "llm"}},
            }
        ],
        "priorityClassName": "inference",
        "volumes": [CA_VOLUME],
        # one entry per component container: each lands in its own pod only
        "containers": [
            {
                "name": component,
                "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
                "envFrom": [{"secretRef": {"name": "extra-settings"}}],
                "volumeMounts": [{"name": "redis-ca", "mountPath": "/etc/redis-ca", "readOnly": True}],
            }
            for component in ("gateway", "scheduler", "detokenizer")
        ],
    },
}


def pods(spec: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """component -> pod template of every workload built for ``spec``."""
    c = dataclasses.replace(ctx(spec), pod_defaults=defaults)
    workloads = [o for o in build_all(c) if o["kind"] in ("Deployment", "StatefulSet")]
    return {w["metadata"]["labels"]["app.kubernetes.io/component"]: w["spec"]["template"] for w in workloads}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_service_template_reaches_every_pod_the_operator_makes() -> None:
    built = pods({**SPEC, "template": SERVICE_TEMPLATE})
    assert set(built) == {"gateway", "scheduler", "detokenizer"}
    given = SERVICE_TEMPLATE["spec"]
    for component, template in built.items():
        pod = template["spec"]
        assert template["metadata"]["labels"]["team"] == "search"
        assert template["metadata"]["annotations"]["owner"] == "search@example.com"
        for field in ("imagePullSecrets", "serviceAccountName", "affinity", "priorityClassName"):
            assert pod[field] == given[field], (component, field)
        assert pod["nodeSelector"]["topology.kubernetes.io/zone"] == "eu-1a"
        assert given["tolerations"][0] in pod["tolerations"]
        assert pod["topologySpreadConstraints"] == given["topologySpreadConstraints"]
        assert CA_VOLUME in pod["volumes"]
        (container,) = pod["containers"]  # its own entry merged in; the others' not added as sidecars
        assert container["name"] == component
        assert env_of(container)["HTTPS_PROXY"] == "http://proxy:3128"
        assert {"secretRef": {"name": "extra-settings"}} in container["envFrom"]
        assert {"configMapRef": {"name": "llm-engine"}} in container["envFrom"]  # ours stays
        assert container["volumeMounts"][-1] == {
            "name": "redis-ca",
            "mountPath": "/etc/redis-ca",
            "readOnly": True,
        }
    # The pool's placement and the template's add up on the schedulers.
    assert built["scheduler"]["spec"]["nodeSelector"] == {
        "gpu": "h100",
        "topology.kubernetes.io/zone": "eu-1a",
    }
    assert built["scheduler"]["spec"]["tolerations"][0]["key"] == "radixserve.io/inference"


def test_operator_defaults_then_the_service_template_then_the_components() -> None:
    defaults = {
        "metadata": {"labels": {"cost-center": "ml", "team": "platform"}},
        "spec": {
            "imagePullSecrets": [{"name": "mirror"}],
            "priorityClassName": "low",
            "serviceAccountName": "d",
        },
    }
    spec = {
        **SPEC,
        "template": {"metadata": {"labels": {"team": "search"}}, "spec": {"priorityClassName": "normal"}},
        "scheduler": {**SPEC["scheduler"], "template": {"spec": {"priorityClassName": "gpu-critical"}}},
        "tokenizer": {"template": {"spec": {"imagePullSecrets": [{"name": "mirror"}, {"name": "private"}]}}},
    }
    built = pods(spec, defaults)
    priorities = {c: t["spec"]["priorityClassName"] for c, t in built.items()}
    assert priorities == {"gateway": "normal", "scheduler": "gpu-critical", "detokenizer": "normal"}
    for template in built.values():
        assert template["metadata"]["labels"]["cost-center"] == "ml"  # the defaults' own key stays
        assert template["metadata"]["labels"]["team"] == "search"  # the service's wins over the defaults
        assert template["spec"]["serviceAccountName"] == "d"
    secrets = {c: [s["name"] for s in t["spec"]["imagePullSecrets"]] for c, t in built.items()}
    assert secrets == {"gateway": ["mirror", "private"], "scheduler": ["mirror"], "detokenizer": ["mirror"]}
    # Without any template the pods are exactly as the operator builds them.
    assert pods(SPEC, {}) == pods(SPEC)


def test_containers_env_and_volumes_merge_by_name_lists_append_and_sidecars_add() -> None:
    scheduler_template = {
        "spec": {
            "containers": [
                {
                    "name": "scheduler",
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                    "resources": {"limits": {"memory": "64Gi"}},
                    "volumeMounts": [{"name": "cache", "mountPath": "/cache", "subPath": "pod"}],
                },
                {"name": "log-shipper", "image": "fluent-bit:3", "args": ["--quiet"]},
            ],
            "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "200Gi"}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    }
    spec = {**SPEC, "scheduler": {**SPEC["scheduler"], "template": scheduler_template}}
    pod = pods(spec)["scheduler"]["spec"]
    scheduler, shipper = pod["containers"]
    assert shipper == {"name": "log-shipper", "image": "fluent-bit:3", "args": ["--quiet"]}
    env = env_of(scheduler)
    assert env["NCCL_DEBUG"] == "INFO" and env["RADIXSERVE_PORT"] == "50051"
    assert scheduler["resources"] == {  # maps merge key by key: the GPU limit and the requests stay
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"nvidia.com/gpu": 1, "memory": "64Gi"},
    }
    # volumes by name and mounts by mountPath: the entry replaced whole, in its place
    assert {"name": "cache", "emptyDir": {"sizeLimit": "200Gi"}} in pod["volumes"]
    assert {"name": "cache", "emptyDir": {}} not in pod["volumes"]
    mounts = [m for m in scheduler["volumeMounts"] if m["mountPath"] == "/cache"]
    assert mounts == [{"name": "cache", "mountPath": "/cache", "subPath": "pod"}]
    assert [t["key"] for t in pod["tolerations"]] == ["radixserve.io/inference", "nvidia.com/gpu"]


def test_the_operator_keeps_its_labels_config_hash_command_ports_and_env() -> None:
    hostile = {
        "metadata": {
            "labels": {"app.kubernetes.io/instance": "other", "app.kubernetes.io/component": "x"},
            "annotations": {"radixserve.io/config-hash": "0", "prometheus.io/scrape": "false"},
        },
        "spec": {
            "securityContext": {"runAsUser": 2000},
            "containers": [
                {
                    "name": "gateway",
                    "command": ["sleep", "infinity"],
                    "ports": [{"containerPort": 1}],
                    "env": [{"name": "RADIXSERVE_SCHEDULERS", "value": "elsewhere:1"}],
                    "readinessProbe": {"failureThreshold": 10},
                    "livenessProbe": {"httpGet": {"path": "/live", "port": 8000}},
                }
            ],
        },
    }
    plain = pods(SPEC)["gateway"]
    got = pods({**SPEC, "tokenizer": {"template": hostile}})["gateway"]
    assert got["metadata"]["labels"] == plain["metadata"]["labels"]
    annotations = got["metadata"]["annotations"]
    assert (
        annotations["radixserve.io/config-hash"]
        == plain["metadata"]["annotations"]["radixserve.io/config-hash"]
    )
    assert annotations["prometheus.io/scrape"] == "false"  # not the operator's to keep
    (container,) = got["spec"]["containers"]
    (ours,) = plain["spec"]["containers"]
    assert container["command"] == ours["command"] and container["ports"] == ours["ports"]
    assert env_of(container)["RADIXSERVE_SCHEDULERS"] == "discover"
    # A probe's thresholds change on ours; a probe with its own handler replaces ours.
    assert container["readinessProbe"] == {**ours["readinessProbe"], "failureThreshold": 10}
    assert container["livenessProbe"] == {
        "httpGet": {"path": "/live", "port": 8000},
        "periodSeconds": 10,
        "failureThreshold": 6,
    }
    # The pod's securityContext may be changed (key by key): a cluster with its own profile.
    assert got["spec"]["securityContext"] == {**plain["spec"]["securityContext"], "runAsUser": 2000}


def test_the_schema_takes_templates_and_names_what_is_wrong() -> None:
    spec = {
        **SPEC,
        "template": SERVICE_TEMPLATE,
        "scheduler": {**SPEC["scheduler"], "template": {"spec": {"runtimeClassName": "nvidia"}}},
    }
    assert schema_problems(crds.INFERENCE_SERVICE_SPEC, spec) == []
    jsonschema.Draft4Validator(crds.INFERENCE_SERVICE_SPEC).validate(spec)
    cases = [
        ({"imagePullSecrets": [{}]}, "spec.template.spec.imagePullSecrets[0].name: required"),
        (
            {"tolerations": [{"key": "a", "operator": "Maybe"}]},
            "spec.template.spec.tolerations[0].operator: must be one of",
        ),
        ({"containers": [{"image": "x"}]}, "spec.template.spec.containers[0].name: required"),
        ({"nodeSelector": {"gpu": 1}}, "spec.template.spec.nodeSelector.gpu: must be a string"),
        ({"volumes": [{"configMap": {"name": "x"}}]}, "spec.template.spec.volumes[0].name: required"),
        ({"serviceAccountName": ["a"]}, "spec.template.spec.serviceAccountName: must be a string"),
        ({"hostNetwork": True}, "spec.template.spec.hostNetwork: unknown field"),
        (
            {"containers": [{"name": "x", "env": [{"value": "1"}]}]},
            "spec.template.spec.containers[0].env[0].name: required",
        ),
    ]
    for pod_spec, words in cases:
        problems = schema_problems(crds.INFERENCE_SERVICE_SPEC, {**SPEC, "template": {"spec": pod_spec}})
        assert len(problems) == 1 and problems[0].startswith(words), (pod_spec, problems)


def test_operator_defaults_come_from_the_environment_and_a_bad_one_stops_the_operator() -> None:
    given = '{"spec": {"imagePullSecrets": [{"name": "mirror"}]}}'
    assert OperatorConfig.from_env({POD_DEFAULTS_ENV: given}).pod_defaults == {
        "spec": {"imagePullSecrets": [{"name": "mirror"}]}
    }
    assert OperatorConfig.from_env({}).pod_defaults == {}
    for text, words in [
        ("{not json", "is not JSON"),
        ('{"spec": {"imagePullSecrets": ["mirror"]}}', "imagePullSecrets[0]: must be an object"),
        ('{"imagePullSecrets": []}', "imagePullSecrets: unknown field"),
    ]:
        with pytest.raises(ValueError, match=POD_DEFAULTS_ENV) as raised:
            OperatorConfig.from_env({POD_DEFAULTS_ENV: text})
        assert words in str(raised.value)


@pytest.mark.parametrize("version", ["1.28.0", "1.37.0"])
def test_templated_objects_are_valid_kubernetes(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    spec = {**SPEC, "template": SERVICE_TEMPLATE}
    for obj in build_all(
        dataclasses.replace(ctx(spec, pool=POOL), pod_defaults={"spec": {"runtimeClassName": "nvidia"}})
    ):
        kv.validate(obj, version, strict=True)
