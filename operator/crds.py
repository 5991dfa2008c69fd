"""The InferenceService and GPUNodePool CustomResourceDefinitions: the single source (written in
schema.py's vocabulary; defaulting and the operator's own checks are there too).

The chart's ``helm/radixserve/crds/*.yaml`` are rendered from here (``python -m
radixserve.operator.crds helm/radixserve/crds``; a test fails when they drift), and the
operator fills defaults from the same schemas with :func:`apply_defaults`, so a spec means
the same thing whether the API server defaulted it or not.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TypedDict

from radixserve.common.service_config import DRAIN_TIMEOUT_S, ROUTERS, ROUTING_DEFAULTS, SCHEDULE_POLICIES
from radixserve.operator.schema import (
    ANY_OBJECTS,
    CONDITIONS,
    RESOURCES,
    SECRET_KEY,
    Obj,
    Schema,
    integer,
    obj,
    string,
)
from radixserve.operator.tls import REDIS_CA_SCHEMA, TLS_SCHEMA
from radixserve.operator.volumes import MODEL_SCHEMA

GROUP = "radixserve.io"
VERSION = "v1alpha1"


class _PrinterColumnFields(TypedDict):
    name: str
    type: str
    jsonPath: str


class PrinterColumn(_PrinterColumnFields, total=False):
    """One of a CRD version's ``additionalPrinterColumns`` (kubectl get's columns)."""

    priority: int  # 1: only with kubectl get -o wide


ENGINE_SCHEMA = obj(
    {
        "pageSize": integer(1, description="tokens per KV page (--page-size)"),
        "chunkedPrefillSize": integer(1, description="tokens per prefill chunk (--chunked-prefill-size)"),
        "maxRunningRequests": integer(1, description="--max-running-requests"),
        "maxTotalTokens": integer(1, description="KV pool size in tokens (--max-total-tokens)"),
        "memFraction": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
        "schedulePolicy": string(enum=list(SCHEDULE_POLICIES)),
        "fairnessTimeout": {"type": "number", "minimum": 0, "description": "seconds (--fairness-timeout)"},
        "overlap": {"type": "boolean", "description": "overlap scheduling (default: on for CUDA)"},
        "dtype": string(),
        "attentionBackend": string(),
    },
    default={},
)

INFERENCE_SERVICE_SPEC = obj(
    {
        "model": MODEL_SCHEMA,
        "image": string(description="defaults to the operator's image"),
        "imagePullPolicy": string(default="IfNotPresent", enum=["Always", "IfNotPresent", "Never"]),
        "tokenizer": obj({"replicas": integer(1, 1), "resources": RESOURCES}, default={}),
        "detokenizer": obj({"replicas": integer(1, 1), "resources": RESOURCES}, default={}),
        "scheduler": obj(
            {
                "replicas": integer(0, 1),
                "device": string(default="cuda", enum=["cuda", "cpu"]),
                "gpusPerReplica": integer(
                    0,
                    1,
                    description="GPUs per scheduler pod; above 1 the model is split across them with "
                    "tensor parallelism (--tp-size): its attention heads (and KV heads, or the reverse) "
                    "and MLP size must divide by it; a model that does not is reported in status "
                    "(Degraded/SchedulerFailed)",
                ),
                "nodePool": string(description="name of a GPUNodePool"),
                "resources": RESOURCES,
                "drainTimeoutSeconds": integer(0, int(DRAIN_TIMEOUT_S)),
                "engine": ENGINE_SCHEMA,
            },
            default={},
        ),
        "routing": obj(
            {
                "policy": string(default=ROUTING_DEFAULTS.router, enum=list(ROUTERS)),
                "balanceAbsThreshold": integer(0),
                "balanceRelThreshold": {"type": "number", "minimum": 1},
                "blockSize": integer(
                    0,
                    ROUTING_DEFAULTS.block_size,
                    description="tokens per hashed block (gateway and schedulers)",
                ),
            },
            default={},
        ),
        "redis": obj(
            {
                "mode": string(
                    default="chart",
                    enum=["chart", "external", "none"],
                    description="chart: the Redis the chart installed; external: urlSecretRef; none: "
                    "in-memory index (one gateway, no autoscaling)",
                ),
                "urlSecretRef": SECRET_KEY,
                "caSecretRef": REDIS_CA_SCHEMA,
            },
            default={},
        ),
        "autoscaling": obj(
            {
                "enabled": {"type": "boolean", "default": False},
                "minReplicas": integer(0, 1),
                "maxReplicas": integer(1, 4),
                "targetWaitingPerReplica": {
                    "type": "number",
                    "exclusiveMinimum": True,
                    "minimum": 0,
                    "default": 8,
                },
                "scaleUpStabilizationSeconds": integer(0, 0),
                "scaleDownStabilizationSeconds": integer(0, 300),
            },
            default={},
        ),
        "auth": obj(
            {
                "apiKeySecretRef": SECRET_KEY
                | {
                    "description": "the API keys clients must send (Authorization: Bearer KEY), one per "
                    'line, in this Secret key (default "api-keys"); unset: no check'
                },
                "protectMetrics": {"type": "boolean", "default": False, "description": "/metrics too"},
            },
            default={},
        ),
        "networkPolicy": obj(
            {
                "enabled": {"type": "boolean", "description": "default: the operator's (chart) setting"},
                "gatewayFrom": ANY_OBJECTS
                | {"description": "NetworkPolicyPeers that may reach the gateway; default: this namespace"},
                "extraEgress": ANY_OBJECTS
                | {"description": "more NetworkPolicyEgressRules for every pod (e.g. an external Redis)"},
            },
            default={},
        ),
        "tls": TLS_SCHEMA,
        "tracing": obj(
            {
                "otlpEndpoint": string(description="OTLP/gRPC collector, e.g. http://otel-collector:4317"),
                "sampleRatio": {"type": "number", "minimum": 0, "maximum": 1, "default": 0.1},
            },
            default={},
        ),
    },
    required=["model"],
)

INFERENCE_SERVICE_STATUS = obj(
    {
        "observedGeneration": {"type": "integer"},
        "conditions": CONDITIONS,
        "replicas": obj(
            {
                "gateway": string(description="ready/desired"),
                "scheduler": string(description="ready/desired"),
                "detokenizer": string(description="ready/desired"),
            }
        ),
        "readyReplicas": obj(
            {
                "gateway": {"type": "integer"},
                "scheduler": {"type": "integer"},
                "detokenizer": {"type": "integer"},
            }
        ),
        "schedulerReplicas": {"type": "integer", "description": "the scheduler count in force"},
        "autoscaling": obj(
            {
                "desiredReplicas": {"type": "integer"},
                "lastScaleTime": string(),
                "waiting": {"type": "integer"},
            }
        ),
        "endpoint": obj({"http": string(), "grpc": string()}),
    },
) | {"x-kubernetes-preserve-unknown-fields": True}

GPU_NODE_POOL_SPEC = obj(
    {
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "gpuResourceName": string(default="nvidia.com/gpu"),
        "taint": obj(
            {
                "key": string(default="radixserve.io/inference"),
                "value": string(default="true"),
                "effect": string(default="NoSchedule", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
            },
            description="when set, the pool's nodes are reserved for radixserve scheduler pods",
        ),
        "minNodes": integer(0, description="hint for the cluster autoscaler"),
        "maxNodes": integer(0, description="hint for the cluster autoscaler"),
    },
    required=["nodeSelector"],
)

GPU_NODE_POOL_STATUS = obj(
    {
        "observedGeneration": {"type": "integer"},
        "nodes": {"type": "integer"},
        "readyNodes": {"type": "integer"},
        "nodeNames": {"type": "array", "items": string()},
        "gpus": obj(
            {
                "total": {"type": "integer"},
                "allocatable": {"type": "integer"},
                "requested": {"type": "integer"},
            }
        ),
        "conditions": CONDITIONS,
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
