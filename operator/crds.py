"""The InferenceService and GPUNodePool CustomResourceDefinitions: the single source.

The chart's ``helm/radixserve/crds/*.yaml`` are rendered from here (``python -m
radixserve.operator.crds helm/radixserve/crds``; a test fails when they drift), and the
operator fills defaults from the same schemas with :func:`apply_defaults`, so a spec means
the same thing whether the API server defaulted it or not.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import TypedDict, TypeVar

from radixserve.common.service_config import DRAIN_TIMEOUT_S, ROUTERS, ROUTING_DEFAULTS, SCHEDULE_POLICIES
from radixserve.operator.manifests import Obj
from radixserve.operator.tls import REDIS_CA_SCHEMA, TLS_SCHEMA

GROUP = "radixserve.io"
VERSION = "v1alpha1"

Schema = Obj  # an OpenAPI v3 schema node
JsonT = TypeVar("JsonT")  # a JSON value: what a schema describes


class _PrinterColumnFields(TypedDict):
    name: str
    type: str
    jsonPath: str


class PrinterColumn(_PrinterColumnFields, total=False):
    """One of a CRD version's ``additionalPrinterColumns`` (kubectl get's columns)."""

    priority: int  # 1: only with kubectl get -o wide


def _int(minimum: int = 0, default: int | None = None, **kw: object) -> Schema:
    s: Schema = {"type": "integer", "minimum": minimum, **kw}
    if default is not None:
        s["default"] = default
    return s


def _str(default: str | None = None, **kw: object) -> Schema:
    s: Schema = {"type": "string", **kw}
    if default is not None:
        s["default"] = default
    return s


def _obj(props: dict[str, Schema], *, default: Obj | None = None, **kw: object) -> Schema:
    s: Schema = {"type": "object", "properties": props, **kw}
    if default is not None:
        s["default"] = default
    return s


# Container resources are the core type; preserving unknown fields keeps the CRD small and lets
# the API server (not us) validate quantities.
_RESOURCES: Schema = {
    "type": "object",
    "description": "Container resources (requests/limits), as in a Pod spec.",
    "x-kubernetes-preserve-unknown-fields": True,
}
_SECRET_KEY = _obj(
    {"name": _str(minLength=1), "key": _str()},
    required=["name"],
    description="A key of a Secret in the InferenceService's namespace.",
)
_ANY_OBJECTS: Schema = {
    "type": "array",
    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
}
_CONDITIONS: Schema = {
    "type": "array",
    "items": _obj(
        {
            "type": _str(),
            "status": _str(enum=["True", "False", "Unknown"]),
            "reason": _str(),
            "message": _str(),
            "lastTransitionTime": _str(format="date-time"),
            "observedGeneration": {"type": "integer"},
        },
        required=["type", "status"],
    ),
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}

ENGINE_SCHEMA = _obj(
    {
        "pageSize": _int(1, description="tokens per KV page (--page-size)"),
        "chunkedPrefillSize": _int(1, description="tokens per prefill chunk (--chunked-prefill-size)"),
        "maxRunningRequests": _int(1, description="--max-running-requests"),
        "maxTotalTokens": _int(1, description="KV pool size in tokens (--max-total-tokens)"),
        "memFraction": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
        "schedulePolicy": _str(enum=list(SCHEDULE_POLICIES)),
        "fairnessTimeout": {"type": "number", "minimum": 0, "description": "seconds (--fairness-timeout)"},
        "overlap": {"type": "boolean", "description": "overlap scheduling (default: on for CUDA)"},
        "dtype": _str(),
        "attentionBackend": _str(),
    },
    default={},
)

INFERENCE_SERVICE_SPEC = _obj(
    {
        "model": _obj(
            {
                "path": _str(description='folder inside the pod, or "demo" for the built-in tiny model'),
                "servedModelName": _str(),
                "source": _obj(
                    {
                        "pvc": _obj(
                            {"claimName": _str(minLength=1), "subPath": _str(default="")},
                            required=["claimName"],
                        ),
                        "hub": _obj(
                            {
                                "id": _str(minLength=1, description="Hugging Face repository id"),
                                "revision": _str(),
                                "tokenSecretRef": _SECRET_KEY,
                            },
                            required=["id"],
                        ),
                    },
                    description="Where the model comes from when it is not baked into the image.",
                ),
            },
            description="Exactly one of path or source (pvc or hub).",
        ),
        "image": _str(description="defaults to the operator's image"),
        "imagePullPolicy": _str(default="IfNotPresent", enum=["Always", "IfNotPresent", "Never"]),
        "tokenizer": _obj({"replicas": _int(1, 1), "resources": _RESOURCES}, default={}),
        "detokenizer": _obj({"replicas": _int(1, 1), "resources": _RESOURCES}, default={}),
        "scheduler": _obj(
            {
                "replicas": _int(0, 1),
                "device": _str(default="cuda", enum=["cuda", "cpu"]),
                "gpusPerReplica": _int(
                    0,
                    1,
                    description="GPUs per scheduler pod; above 1 the model is split across them with "
                    "tensor parallelism (--tp-size): its attention heads (and KV heads, or the reverse) "
                    "and MLP size must divide by it; a model that does not is reported in status "
                    "(Degraded/SchedulerFailed)",
                ),
                "nodePool": _str(description="name of a GPUNodePool"),
                "resources": _RESOURCES,
                "drainTimeoutSeconds": _int(0, int(DRAIN_TIMEOUT_S)),
                "engine": ENGINE_SCHEMA,
            },
            default={},
        ),
        "routing": _obj(
            {
                "policy": _str(default=ROUTING_DEFAULTS.router, enum=list(ROUTERS)),
                "balanceAbsThreshold": _int(0),
                "balanceRelThreshold": {"type": "number", "minimum": 1},
                "blockSize": _int(
                    0,
                    ROUTING_DEFAULTS.block_size,
                    description="tokens per hashed block (gateway and schedulers)",
                ),
            },
            default={},
        ),
        "redis": _obj(
            {
                "mode": _str(
                    default="chart",
                    enum=["chart", "external", "none"],
                    description="chart: the Redis the chart installed; external: urlSecretRef; none: "
                    "in-memory index (one gateway, no autoscaling)",
                ),
                "urlSecretRef": _SECRET_KEY,
                "caSecretRef": REDIS_CA_SCHEMA,
            },
            default={},
        ),
        "autoscaling": _obj(
            {
                "enabled": {"type": "boolean", "default": False},
                "minReplicas": _int(0, 1),
                "maxReplicas": _int(1, 4),
                "targetWaitingPerReplica": {
                    "type": "number",
                    "exclusiveMinimum": True,
                    "minimum": 0,
                    "default": 8,
                },
                "scaleUpStabilizationSeconds": _int(0, 0),
                "scaleDownStabilizationSeconds": _int(0, 300),
            },
            default={},
        ),
        "auth": _obj(
            {
                "apiKeySecretRef": _SECRET_KEY
                | {
                    "description": "the API keys clients must send (Authorization: Bearer KEY), one per "
                    'line, in this Secret key (default "api-keys"); unset: no check'
                },
                "protectMetrics": {"type": "boolean", "default": False, "description": "/metrics too"},
            },
            default={},
        ),
        "networkPolicy": _obj(
            {
                "enabled": {"type": "boolean", "description": "default: the operator's (chart) setting"},
                "gatewayFrom": _ANY_OBJECTS
                | {"description": "NetworkPolicyPeers that may reach the gateway; default: this namespace"},
                "extraEgress": _ANY_OBJECTS
                | {"description": "more NetworkPolicyEgressRules for every pod (e.g. an external Redis)"},
            },
            default={},
        ),
        "tls": TLS_SCHEMA,
        "tracing": _obj(
            {
                "otlpEndpoint": _str(description="OTLP/gRPC collector, e.g. http://otel-collector:4317"),
                "sampleRatio": {"type": "number", "minimum": 0, "maximum": 1, "default": 0.1},
            },
            default={},
        ),
    },
    required=["model"],
)

INFERENCE_SERVICE_STATUS = _obj(
    {
        "observedGeneration": {"type": "integer"},
        "conditions": _CONDITIONS,
        "replicas": _obj(
            {
                "gateway": _str(description="ready/desired"),
                "scheduler": _str(description="ready/desired"),
                "detokenizer": _str(description="ready/desired"),
            }
        ),
        "readyReplicas": _obj(
            {
                "gateway": {"type": "integer"},
                "scheduler": {"type": "integer"},
                "detokenizer": {"type": "integer"},
            }
        ),
        "schedulerReplicas": {"type": "integer", "description": "the scheduler count in force"},
        "autoscaling": _obj(
            {"desiredReplicas": {"type": "integer"}, "lastScaleTime": _str(), "waiting": {"type": "integer"}}
        ),
        "endpoint": _obj({"http": _str(), "grpc": _str()}),
    },
) | {"x-kubernetes-preserve-unknown-fields": True}

GPU_NODE_POOL_SPEC = _obj(
    {
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "gpuResourceName": _str(default="nvidia.com/gpu"),
        "taint": _obj(
            {
                "key": _str(default="radixserve.io/inference"),
                "value": _str(default="true"),
                "effect": _str(default="NoSchedule", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
            },
            description="when set, the pool's nodes are reserved for radixserve scheduler pods",
        ),
        "minNodes": _int(0, description="hint for the cluster autoscaler"),
        "maxNodes": _int(0, description="hint for the cluster autoscaler"),
    },
    required=["nodeSelector"],
)

GPU_NODE_POOL_STATUS = _obj(
    {
        "observedGeneration": {"type": "integer"},
        "nodes": {"type": "integer"},
        "readyNodes": {"type": "integer"},
        "nodeNames": {"type": "array", "items": _str()},
        "gpus": _obj(
            {
                "total": {"type": "integer"},
                "allocatable": {"type": "integer"},
                "requested": {"type": "integer"},
            }
        ),
        "conditions": _CONDITIONS,
    },
) | {"x-kubernetes-preserve-unknown-fields": True}


def _crd(
    kind: str,
    plural: str,
    scope: str,
    spec: Schema,
    status: Schema,
    columns: list[PrinterColumn],
    short: list[str],
) -> Obj:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
                "categories": ["radixserve"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                            "required": ["spec"],
                        }
                    },
                }
            ],
        },
    }


def _cond(name: str) -> PrinterColumn:
    return {"name": name, "type": "string", "jsonPath": f'.status.conditions[?(@.type=="{name}")].status'}


INFERENCE_SERVICE_CRD = _crd(
    "InferenceService",
    "inferenceservices",
    "Namespaced",
    INFERENCE_SERVICE_SPEC,
    INFERENCE_SERVICE_STATUS,
    [
        _cond("Ready"),
        {"name": "Schedulers", "type": "string", "jsonPath": ".status.replicas.scheduler"},
        {"name": "Gateways", "type": "string", "jsonPath": ".status.replicas.gateway"},
        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint.http"},
        {
            "name": "Reason",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Degraded")].reason',
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
    ["rxs"],  # not "isvc": KServe's InferenceService has that one
)

GPU_NODE_POOL_CRD = _crd(
    "GPUNodePool",
    "gpunodepools",
    "Cluster",
    GPU_NODE_POOL_SPEC,
    GPU_NODE_POOL_STATUS,
    [
        {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes"},
        {"name": "GPUs", "type": "integer", "jsonPath": ".status.gpus.allocatable"},
        {"name": "Requested", "type": "integer", "jsonPath": ".status.gpus.requested"},
        {"name": "Resource", "type": "string", "jsonPath": ".spec.gpuResourceName", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
    ["gpupool", "gpupools"],
)

CRDS = {"inferenceservices": INFERENCE_SERVICE_CRD, "gpunodepools": GPU_NODE_POOL_CRD}


def apply_defaults(schema: Schema, value: JsonT) -> JsonT:
    """A defaulted deep copy of ``value``, as the API server's structural defaulting would give.

    Nested defaults apply only where the parent exists, which is why the parents above carry
    ``default: {}``. The operator calls this too: objects written before a default was added, and
    API emulators that do not default, must read the same as freshly admitted ones.
    """
    return _fill_defaults(schema, copy.deepcopy(value))


def _fill_defaults(schema: Schema, value: JsonT) -> JsonT:
    """:func:`apply_defaults` in place, on a copy it owns."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _fill_defaults(sub, value[key])
    elif schema.get("type") == "array" and isinstance(value, list) and "items" in schema:
        value[:] = [_fill_defaults(schema["items"], v) for v in value]
    return value


def schema_problems(schema: Schema, value: object, where: str = "spec") -> list[str]:
    """What the API server's OpenAPI validation would refuse in ``value`` (types, ranges, enums,
    required fields), and the unknown fields it would prune or, with strict field validation,
    refuse: the operator's own check, for a spec that reached it anyway (an older CRD, a cluster
    without validation, an emulator). One message per problem, with its path."""
    if value is None:
        return [] if schema.get("nullable") else [f"{where}: must not be null"]
    kind = schema.get("type")
    ok = {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        None: True,
    }.get(kind, True)
    if not ok:
        article = "an" if kind in ("object", "array", "integer") else "a"
        return [f"{where}: must be {article} {kind}, got {value!r}"]
    out: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: must be one of {schema['enum']}, got {value!r}")
    if "minimum" in schema and isinstance(value, (int, float)):
        low = schema["minimum"]
        if value < low or (schema.get("exclusiveMinimum") and value == low):
            out.append(f"{where}: {value!r} is below the minimum {low}")
    if "maximum" in schema and isinstance(value, (int, float)) and value > schema["maximum"]:
        out.append(f"{where}: {value!r} is above the maximum {schema['maximum']}")
    if "minLength" in schema and isinstance(value, str) and len(value) < schema["minLength"]:
        out.append(f"{where}: must not be empty")
    if kind == "array" and isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += schema_problems(schema["items"], item, f"{where}[{i}]")
    keeps_unknown_fields = schema.get("x-kubernetes-preserve-unknown-fields")
    if kind == "object" and isinstance(value, dict) and not keeps_unknown_fields:
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                out += schema_problems(props[key], item, f"{where}.{key}")
            elif isinstance(extra, dict):
                out += schema_problems(extra, item, f"{where}.{key}")
            elif props is not None:
                out.append(f"{where}.{key}: unknown field (a typo? known: {', '.join(sorted(props))})")
        out += [f"{where}.{key}: required" for key in schema.get("required", []) if key not in value]
    return out


def render(crd: Obj) -> str:
    import yaml

    header = "# Generated by `python -m radixserve.operator.crds helm/radixserve/crds`; do not edit.\n"
    return header + yaml.safe_dump(crd, sort_keys=False, width=100)


def main(argv: list[str]) -> int:
    """``python -m radixserve.operator.crds [DIR]``: write the CRDs (default: the chart's crds/)."""
    if argv and argv[0].startswith("-"):  # --help: not a folder to write into
        print(main.__doc__)
        return 0 if argv[0] in ("-h", "--help") else 2
    out = Path(argv[0] if argv else "helm/radixserve/crds")
    out.mkdir(parents=True, exist_ok=True)
    for plural, crd in CRDS.items():
        (out / f"{plural}.{GROUP}.yaml").write_text(render(crd))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
