"""InferenceService specs and build contexts the operator's pure tests share."""

from __future__ import annotations

from typing import Any

from radixserve.operator.crds import GPU_NODE_POOL_SPEC, INFERENCE_SERVICE_SPEC
from radixserve.operator.manifests import BuildContext
from radixserve.operator.schema import apply_defaults

SPEC: dict[str, Any] = {
    "model": {"source": {"pvc": {"claimName": "models", "subPath": "llama-8b"}}},
    "scheduler": {"replicas": 2, "nodePool": "h100", "engine": {"pageSize": 16, "overlap": True}},
    "tracing": {"otlpEndpoint": "http://otel:4317"},
}


POOL = {"nodeSelector": {"gpu": "h100"}, "taint": {}}


def ctx(spec: dict[str, Any] = SPEC, replicas: int = 2, pool: dict[str, Any] | None = POOL) -> BuildContext:
    return BuildContext(
        name="llm",
        namespace="prod",
        spec=apply_defaults(INFERENCE_SERVICE_SPEC, spec),
        image="img:1",
        scheduler_replicas=replicas,
        chart_redis_url="redis://r:6379/0",
        pool=apply_defaults(GPU_NODE_POOL_SPEC, pool) if pool else None,
        pool_name="h100" if pool else "",
    )


def spec(**kw: object) -> dict:
    return apply_defaults(INFERENCE_SERVICE_SPEC, {"model": {"path": "demo"}, **kw})
