"""The chart after day 1: CRD upgrades, uninstall, two operator replicas, scrape objects, pod
defaults. Rendered by the real helm binary (test_chart's fixtures)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from radixserve.operator import manifests
from radixserve.operator.crds import CRDS
from tests.helm.chart import CHART, one, render, validate_all

OPERATOR = ("Deployment", "rs-radixserve-operator")


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = one(docs, *OPERATOR)["spec"]["template"]["spec"]["containers"][0]
    return container


def grants(role: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(g, r): rule for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


def test_crds_install_from_crds_dir_and_the_operator_upgrades_exactly_ours(helm_env: dict[str, str]) -> None:
    # crds/ is what `helm install` creates (and never updates): our two, rendered from crds.py, and
    # kopf's peering kinds, which the chart's own ClusterKopfPeering needs at install.
    shipped = {
        d["metadata"]["name"]: d
        for f in (CHART / "crds").glob("*.yaml")
        for d in yaml.safe_load_all(f.read_text())
        if d
    }
    assert set(shipped) == {*(c["metadata"]["name"] for c in CRDS.values()), *PEERING_CRDS}
    docs = render(helm_env)
    assert "--apply-crds" in operator_container(docs)["args"]
    role = one(docs, "ClusterRole", "rs-radixserve-operator")
    crd_rules = [r for r in role["rules"] if "customresourcedefinitions" in r["resources"]]
    # list/watch is kopf's discovery; the only write is a patch of our two CRDs, by name.
    writes = [r for r in crd_rules if set(r["verbs"]) - {"list", "watch"}]
    assert [(r["resourceNames"], r["verbs"]) for r in writes] == [
        ([c["metadata"]["name"] for c in CRDS.values()], ["get", "patch"])
    ]

    off = render(helm_env, "--set", "crds.upgrade=false")
    assert "--apply-crds" not in operator_container(off)["args"]
    role = one(off, "ClusterRole", "rs-radixserve-operator")
    assert all(
        set(r["verbs"]) <= {"list", "watch"}
        for r in role["rules"]
        if "customresourcedefinitions" in r["resources"]
    )


PEERING_CRDS = {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


def test_uninstall_hook_deletes_the_services_first_with_its_own_narrow_role(helm_env: dict[str, str]) -> None:
    docs = render(
        helm_env, "--set", "operator.watchNamespaces={ml,staging}", "--set", "uninstall.timeoutSeconds=120"
    )
    validate_all(docs)
    hooks = [d for d in docs if (d["metadata"].get("annotations") or {}).get("helm.sh/hook")]
    assert {(d["kind"], d["metadata"]["name"]) for d in hooks} == {
        ("ServiceAccount", "rs-radixserve-uninstall"),
        ("ClusterRole", "rs-radixserve-uninstall"),
        ("ClusterRoleBinding", "rs-radixserve-uninstall"),
        ("Job", "rs-radixserve-uninstall"),
    }
    for d in hooks:
        ann = d["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == "pre-delete"
        assert "hook-succeeded" in ann["helm.sh/hook-delete-policy"]
    weight = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hooks}
    assert weight["Job"] > max(weight["ServiceAccount"], weight["ClusterRole"], weight["ClusterRoleBinding"])

    job = one(docs, "Job", "rs-radixserve-uninstall")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["serviceAccountName"] == "rs-radixserve-uninstall"
    assert container["command"] == ["python", "-m", "radixserve.operator.uninstall"]
    # Pools are cluster-scoped: an operator limited to namespaces deletes only the chart's own (none).
    assert container["args"] == ["--timeout=120", "--namespace=ml", "--namespace=staging", "--pool="]
    assert job["spec"]["activeDeadlineSeconds"] > 120  # the script's own deadline comes first
    assert container["image"] == operator_container(docs)["image"]
    role = grants(one(docs, "ClusterRole", "rs-radixserve-uninstall"))
    assert {k: set(v["verbs"]) for k, v in role.items()} == {
        ("radixserve.io", "inferenceservices"): {"list", "delete"},
        ("radixserve.io", "gpunodepools"): {"list", "delete"},
    }

    kept = render(helm_env, "--set", "uninstall.deleteResources=false")
    assert not [d for d in kept if (d["metadata"].get("annotations") or {}).get("helm.sh/hook")]


@pytest.mark.parametrize("namespaces", [[], ["ml", "staging"]], ids=["cluster-wide", "namespaced"])
def test_two_operator_replicas_peer_and_one_runs_standalone(
    helm_env: dict[str, str], namespaces: list[str]
) -> None:
    watch = ["--set", "operator.watchNamespaces={" + ",".join(namespaces) + "}"] if namespaces else []
    docs = render(helm_env, *watch)
    validate_all(docs)
    op = one(docs, *OPERATOR)
    assert op["spec"]["replicas"] == 2 and op["spec"]["strategy"]["type"] == "RollingUpdate"
    args = operator_container(docs)["args"]
    assert "--peering=rs-radixserve" in args
    env = {e["name"]: e for e in operator_container(docs)["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # kopf's identity
    peerings = [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
    if namespaces:  # kopf uses the namespaced kind when it watches namespaces
        assert [(d["kind"], d["metadata"]["namespace"]) for d in peerings] == [
            ("KopfPeering", "ml"),
            ("KopfPeering", "staging"),
        ]
    else:
        assert [d["kind"] for d in peerings] == ["ClusterKopfPeering"]
    assert {d["metadata"]["name"] for d in peerings} == {"rs-radixserve"}  # what --peering names
    role = grants(one(docs, "ClusterRole", "rs-radixserve-operator"))
    kind = "kopfpeerings" if namespaces else "clusterkopfpeerings"
    assert {"list", "watch", "patch"} <= set(role[("kopf.dev", kind)]["verbs"])

    single = render(helm_env, "--set", "operator.replicas=1")
    op = one(single, *OPERATOR)
    assert op["spec"]["strategy"]["type"] == "Recreate"
    assert not [a for a in operator_container(single)["args"] if a.startswith("--peering")]
    assert not [d for d in single if d["apiVersion"] == "kopf.dev/v1"]


def test_scrape_objects_only_when_enabled_and_they_select_the_service_pods(helm_env: dict[str, str]) -> None:
    assert not [d for d in render(helm_env) if d["apiVersion"].startswith("monitoring.coreos.com")]
    docs = render(
        helm_env,
        "--set", "monitoring.podMonitor.enabled=true",
        "--set", "monitoring.serviceMonitor.enabled=true",
        "--set", "monitoring.serviceMonitor.labels.release=prometheus",
        "--set", "operator.watchNamespaces={ml}",
    )  # fmt: skip
    validate_all([d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com")])
    pm = one(docs, "PodMonitor", "rs-radixserve-services")
    sm = one(docs, "ServiceMonitor", "rs-radixserve-services")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    ctx = manifests.BuildContext(
        name="llm", namespace="ml", spec={}, image="x", scheduler_replicas=1
    )  # labels() needs only the name
    for monitor in (pm, sm):
        selector = monitor["spec"]["selector"]["matchLabels"]
        for component in ("gateway", "scheduler", "detokenizer"):
            assert selector.items() <= manifests.labels(ctx, component).items(), component
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    assert [(e["port"], e["path"]) for e in pm["spec"]["podMetricsEndpoints"]] == [
        ("http", "/metrics"),  # the gateway's, beside the OpenAI API
        ("metrics", "/metrics"),  # the schedulers' and detokenizers'
    ]
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["http", "metrics"]


def test_pod_defaults_reach_the_operator_with_the_chart_pull_secrets(helm_env: dict[str, str]) -> None:
    def defaults(*values: str) -> Any:
        env = {e["name"]: e.get("value") for e in operator_container(render(helm_env, *values))["env"]}
        raw = env.get("RADIXSERVE_OPERATOR_POD_DEFAULTS")
        return json.loads(raw) if raw is not None else None

    assert defaults() is None
    assert defaults("--set", "imagePullSecrets[0].name=regcred") == {
        "spec": {"imagePullSecrets": [{"name": "regcred"}]}
    }
    given = defaults(
        "--set", "imagePullSecrets[0].name=regcred",
        "--set", "podDefaults.spec.imagePullSecrets[0].name=mine",
        "--set", "podDefaults.spec.priorityClassName=inference",
        "--set", "podDefaults.metadata.labels.team=ml",
    )  # fmt: skip
    assert given == {
        "metadata": {"labels": {"team": "ml"}},
        "spec": {"imagePullSecrets": [{"name": "mine"}], "priorityClassName": "inference"},
    }
