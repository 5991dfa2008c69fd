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

from radixserve.common.service_config import (
    CLIENT_DEADLINE_S,
    DRAIN_TIMEOUT_S,
    MAX_HELD_REQUESTS,
    ROUTERS,
    ROUTING_DEFAULTS,
    SCHEDULE_POLICIES,
)
from radixserve.operator.manifests import MAX_NAME_LENGTH
from radixserve.operator.nodepool import NODE_LIMITS_MESSAGE
from radixserve.operator.objects import Obj
from radixserve.operator.schema import (
    ANY_OBJECTS,
    CONDITIONS,
    RESOURCES,
    SECRET_KEY,
    Schema,
    integer,
    obj,
    string,
)
from radixserve.operator.templates import TEMPLATE_SCHEMA, TOLERATIONS
from radixserve.operator.tls import REDIS_CA_SCHEMA, TLS_SCHEMA
from radixserve.operator.validation import NAME_FORMAT, NAME_FORMAT_MESSAGE, NAME_LENGTH_MESSAGE
from radixserve.operator.volumes import MODEL_SCHEMA

GROUP = "radixserve.io"
VERSION = "v1alpha1"
# Which schema this is: bump it with every change to the CRDs (tests/operator/test_logic.py pins the
# schemas' digest to it). The operator applies its CRDs at start only over an older or equal one, so
# an older replica (a rollback, a pod restarting mid-rollout) never takes new fields away.
CRD_REVISION = 5
REVISION_ANNOTATION = f"{GROUP}/crd-revision"


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

# The built-in autoscaler's settings (mode operator), in spec.scheduler.autoscaling and in the
# deprecated spec.autoscaling alike.
_SCALE_SETTINGS: dict[str, Schema] = {
    "minReplicas": integer(1, 1),
    "maxReplicas": integer(1, 4),
    "targetWaitingPerReplica": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "default": 8},
    "scaleUpStabilizationSeconds": integer(0, 0),
    "scaleDownStabilizationSeconds": integer(0, 300),
}
_MIN_MAX_RULE = {
    "rule": "self.minReplicas <= self.maxReplicas",
    "message": "minReplicas is above maxReplicas",
}

SCHEDULER_AUTOSCALING = obj(
    {
        "mode": string(
            enum=["off", "operator", "external"],
            description="off (the default): the schedulers follow scheduler.replicas, which a person, "
            "an HPA or KEDA may set through this resource's scale subresource; operator: the built-in "
            "autoscaler sets them from the schedulers' waiting requests (the settings here); external: "
            "an HPA or KEDA scales the NAME-scheduler StatefulSet itself and the operator never writes "
            "its replicas. operator and external need a Redis (redis.mode chart or external): gateways "
            "find the schedulers there. Unset with the deprecated autoscaling.enabled true: operator",
        ),
        **_SCALE_SETTINGS,
        "minReplicas": integer(
            0,
            1,
            description="the fewest schedulers while requests come; 0: the service may scale to zero "
            "(with scaleToZeroAfter, and tokenizer.holdTimeoutSeconds so that the first request after "
            "idle waits for a scheduler instead of failing); at load it runs at least 1",
        ),
        "scaleToZeroAfter": integer(
            1,
            description="seconds without requests (none waiting, running, or held at a gateway) after "
            "which the schedulers scale to 0 (each drains first); a gateway that holds a request "
            "scales them back to minReplicas (at least 1). Mode operator; unset: never below 1",
        ),
    },
    default={},
) | {
    "x-kubernetes-validations": [
        _MIN_MAX_RULE,
        {
            "rule": "self.minReplicas != 0 || has(self.scaleToZeroAfter)",
            "message": "minReplicas 0 needs scaleToZeroAfter (the seconds without requests before zero)",
        },
    ]
}

# minReplicas 0 (and scaleToZeroAfter) serve only where a request at zero waits for a scheduler.
HOLD_RULE = {
    "rule": "(self.scheduler.autoscaling.minReplicas != 0"
    " && !has(self.scheduler.autoscaling.scaleToZeroAfter))"
    " || (has(self.tokenizer.holdTimeoutSeconds) && self.tokenizer.holdTimeoutSeconds > 0)",
    "message": "scheduler.autoscaling.minReplicas 0 and scaleToZeroAfter need tokenizer.holdTimeoutSeconds "
    "above 0: with no scheduler, a request must wait for one instead of failing at once",
}


def _component(replicas: Schema, **more: Schema) -> Schema:
    return obj(
        {"replicas": replicas, "resources": RESOURCES, **more, "template": TEMPLATE_SCHEMA}, default={}
    )


INFERENCE_SERVICE_SPEC = obj(
    {
        "model": MODEL_SCHEMA,
        "image": string(description="defaults to the operator's image"),
        "imagePullPolicy": string(default="IfNotPresent", enum=["Always", "IfNotPresent", "Never"]),
        "template": TEMPLATE_SCHEMA,
        "tokenizer": _component(
            integer(1, 1),
            holdTimeoutSeconds={
                "type": "number",
                "minimum": 0,
                "maximum": CLIENT_DEADLINE_S,
                "description": "seconds a request waits at the gateway for a scheduler when none serves "
                "(scaled to zero, starting) before a 503 (--hold-timeout); 0 or unset: an immediate 503",
            },
            maxHeldRequests=integer(
                1, description="requests held at once per gateway; beyond it a 429 (--max-held-requests)"
            )
            | {"maximum": MAX_HELD_REQUESTS},
        ),
        "detokenizer": _component(integer(1, 1)),
        "scheduler": _component(
            integer(0, 1, description="the scale subresource's replicas (an HPA on this resource sets it)"),
            device=string(default="cuda", enum=["cuda", "cpu"]),
            gpusPerReplica=integer(
                0,
                1,
                description="GPUs per scheduler pod; any count above 1 splits the model across them with "
                "tensor parallelism (--tp-size): its attention heads (and KV heads, or the reverse) "
                "and MLP size must divide by it; a model that does not is reported in status "
                "(Degraded/SchedulerFailed)",
            ),
            nodePool=string(description="name of a GPUNodePool"),
            drainTimeoutSeconds=integer(0, int(DRAIN_TIMEOUT_S)),
            engine=ENGINE_SCHEMA,
            autoscaling=SCHEDULER_AUTOSCALING,
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
            {"enabled": {"type": "boolean", "default": False}, **_SCALE_SETTINGS},
            default={},
            description="Deprecated: use scheduler.autoscaling (enabled true is its mode operator, with "
            "these settings; refused together with scheduler.autoscaling.mode).",
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
) | {"x-kubernetes-validations": [HOLD_RULE]}

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
        "schedulerReplicas": {
            "type": "integer",
            "description": "the scheduler count in force (the scale subresource's replicas)",
        },
        "selector": string(description="label selector of the scheduler pods (the scale subresource's)"),
        "autoscaling": obj(
            {
                "desiredReplicas": {"type": "integer"},
                "lastScaleTime": string(),
                "waiting": {"type": "integer"},
                "held": {"type": "integer", "description": "requests the gateways hold for a scheduler"},
            }
        ),
        "endpoint": obj({"http": string(), "grpc": string()}),
    },
) | {"x-kubernetes-preserve-unknown-fields": True}

_NODE_LIMITS = (
    "Removed: the operator does not size node groups. Set node limits on the provider's object "
    "(Karpenter NodePool spec.limits, the cluster autoscaler node group's min and max size); only 0 "
    "(what older charts wrote) is accepted."
)
GPU_NODE_POOL_SPEC = obj(
    {
        "nodeSelector": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "minProperties": 1,
            "description": "labels of the pool's nodes; scheduler pods select them as they are, so use "
            "labels the provider puts on new nodes (cloud.google.com/gke-accelerator, "
            "karpenter.sh/nodepool, node.kubernetes.io/instance-type, ...) and a node the cluster "
            "autoscaler can add matches",
        },
        "gpuResourceName": string(default="nvidia.com/gpu"),
        "taint": obj(
            {
                "key": string(default="radixserve.io/inference"),
                "value": string(default="true"),
                "effect": string(default="NoSchedule", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
            },
            description="when set, the pool's nodes are reserved for radixserve scheduler pods: the operator "
            "taints the matching nodes it finds and scheduler pods tolerate it; for nodes a cluster "
            "autoscaler adds, set the same taint in the provider's node template (Karpenter NodePool "
            "spec.template.spec.taints, the node group's taints) so they start tainted",
        ),
        "tolerations": TOLERATIONS
        | {"description": "more tolerations for the scheduler pods, e.g. the provider's GPU taint"},
        "minNodes": integer(0, description=_NODE_LIMITS),
        "maxNodes": integer(0, description=_NODE_LIMITS),
    },
    required=["nodeSelector"],
) | {
    "x-kubernetes-validations": [
        {
            "rule": "(!has(self.minNodes) || self.minNodes == 0)"
            " && (!has(self.maxNodes) || self.maxNodes == 0)",
            "message": NODE_LIMITS_MESSAGE,
        }
    ]
}

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
    subresources: Obj | None = None,
    rules: list[Obj] | None = None,
) -> Obj:
    root: Obj = {
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
    if rules:
        root["x-kubernetes-validations"] = rules
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "annotations": {REVISION_ANNOTATION: str(CRD_REVISION)}},
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
                    "subresources": {"status": {}, **(subresources or {})},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": root},
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
    # kubectl scale, an HPA or KEDA set spec.scheduler.replicas (scheduler.autoscaling.mode off) and
    # read the count in force and the scheduler pods' selector from status.
    subresources={
        "scale": {
            "specReplicasPath": ".spec.scheduler.replicas",
            "statusReplicasPath": ".status.schedulerReplicas",
            "labelSelectorPath": ".status.selector",
        }
    },
    # The API server refuses names the children could not carry (the operator checks them too, for
    # servers without CEL: validation.name_problems).
    rules=[
        {"rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}", "message": NAME_LENGTH_MESSAGE},
        {"rule": f"self.metadata.name.matches('{NAME_FORMAT}')", "message": NAME_FORMAT_MESSAGE},
    ],
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
    return header + str(yaml.safe_dump(crd, sort_keys=False, width=100))


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
