"""External mode's scale to zero: the chart renders a KEDA ScaledObject on the scheduler StatefulSet
(minReplicaCount 0, activated by the gateways' held requests), valid against KEDA's own CRD schema
(vendored: tests/helm/keda/, its source in the file's header), and the InferenceService it scales
in mode external with a hold, which the operator accepts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jsonschema
import yaml

from radixserve.operator.crds import INFERENCE_SERVICE_SPEC
from radixserve.operator.schema import apply_defaults
from radixserve.operator.validation import validate
from tests.helm.chart import CHART, HELM, one, render, validate_all

KEDA_CRD = Path(__file__).parent / "keda" / "keda.sh_scaledobjects.yaml"
KEDA = ["--set", "inferenceService.create=true", "--set", "inferenceService.keda.enabled=true"]
# KEDA's prometheus scaler: what its docs say a trigger's metadata must carry (the CRD types the
# metadata only as a map of strings).
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}


def _keda_schema() -> dict:
    (crd,) = [d for d in yaml.safe_load_all(KEDA_CRD.read_text()) if d]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    assert crd["spec"]["group"] == "keda.sh" and crd["spec"]["names"]["kind"] == "ScaledObject"
    return version["schema"]["openAPIV3Schema"]


def test_the_chart_renders_a_scaled_object_keda_accepts_that_wakes_on_held_requests(
    helm_env: dict[str, str],
) -> None:
    docs = render(helm_env, *KEDA, "--set", "inferenceService.keda.cooldownPeriod=120")
    scaled = one(docs, "ScaledObject", "llm-scheduler")
    jsonschema.Draft4Validator(_keda_schema()).validate(scaled)
    validate_all([d for d in docs if d["kind"] != "ScaledObject"])
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "llm-scheduler"}
    assert spec["minReplicaCount"] == 0 and spec["cooldownPeriod"] == 120
    held, waiting = spec["triggers"]
    for t in (held, waiting):
        assert t["type"] == "prometheus" and set(t["metadata"]) >= PROMETHEUS_REQUIRED
    assert held["metadata"]["activationThreshold"] == "0"  # one held request wakes it
    assert 'radixserve_held_requests{namespace="serving",pod=~"llm-gateway-.*"}' in held["metadata"]["query"]
    assert "radixserve_scheduler_waiting_requests" in waiting["metadata"]["query"]
    # The InferenceService it scales: mode external (KEDA owns the replicas), and a hold.
    isvc = one(docs, "InferenceService", "llm")
    assert isvc["spec"]["scheduler"]["autoscaling"] == {"mode": "external"}
    assert isvc["spec"]["tokenizer"] == {"holdTimeoutSeconds": 300}
    assert validate(apply_defaults(INFERENCE_SERVICE_SPEC, isvc["spec"]), None, "redis://r") == []


def test_without_keda_nothing_of_it_renders(helm_env: dict[str, str]) -> None:
    docs = render(helm_env, "--set", "inferenceService.create=true")
    assert not [d for d in docs if d["kind"] == "ScaledObject"]
    assert "tokenizer" not in one(docs, "InferenceService", "llm")["spec"]


def test_keda_with_another_autoscaling_mode_is_refused_naming_it(helm_env: dict[str, str]) -> None:
    mode = ["--set", "inferenceService.spec.scheduler.autoscaling.mode=operator"]
    done = subprocess.run(
        [HELM or "helm", "template", "rs", str(CHART), *KEDA, *mode],
        env=helm_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "mode must be external (not operator)" in done.stderr, done.stderr
