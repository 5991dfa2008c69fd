"""The chart's security defaults: Redis with ACLs (admin password in a Secret, no default user),
credentials only through Secrets, NetworkPolicies, least-privilege RBAC, the API key Secret."""

from __future__ import annotations

import base64
import json
import re

import pytest

from tests.helm.chart import CHART, NON_DEFAULT, Doc, helm, one, render, validate_all


def containers(docs: list[Doc]) -> list[Doc]:
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    return [c for pod in pods for c in pod.get("initContainers", []) + pod["containers"]]


def test_redis_runs_with_acls_and_an_admin_password_from_a_secret(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    secret = one(docs, "Secret", "rs-radixserve-redis-auth")
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) >= 32 and password.isalnum()
    conf = one(docs, "ConfigMap", "rs-radixserve-redis")["data"]["redis.conf"]
    settings = dict(line.split(" ", 1) for line in conf.splitlines() if line and not line.startswith("#"))
    assert settings["aclfile"] == "/data/users.acl"
    assert settings["maxmemory-policy"] == "volatile-lru"
    assert settings["save"] == '""' and settings["appendonly"] == "no"
    sts = one(docs, "StatefulSet", "rs-radixserve-redis")
    pod = sts["spec"]["template"]["spec"]
    (redis,) = pod["containers"]
    script = redis["command"][-1]
    # The ACL file: no default user, the admin with a hashed password, then Redis from that config.
    assert "user default off resetpass" in script and "user %s on #%s ~* &* +@all" in script
    assert "sha256sum" in script and script.rstrip().endswith("exec redis-server /etc/redis/redis.conf")
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in redis["env"]}
    assert env["REDISCLI_AUTH"] == {"secretKeyRef": {"name": "rs-radixserve-redis-auth", "key": "password"}}
    assert "--user" in " ".join(redis["readinessProbe"]["exec"]["command"])
    assert {"name": "config", "mountPath": "/etc/redis", "readOnly": True} in redis["volumeMounts"]
    assert pod["automountServiceAccountToken"] is False


def test_existing_secret_and_eviction_policy_values(helm_env: dict[str, str]) -> None:
    docs = render(
        helm_env,
        *("--set", "redis.auth.existingSecret=my-redis", "--set", "redis.auth.existingSecretKey=pw"),
        *("--set", "redis.maxmemoryPolicy=allkeys-lru"),
    )
    validate_all(docs)
    assert not [d for d in docs if d["kind"] == "Secret"]  # the user's Secret, not ours
    ref = {"secretKeyRef": {"name": "my-redis", "key": "pw"}}
    for c in containers(docs):
        by_name = {e["name"]: e.get("valueFrom") for e in c.get("env", [])}
        assert ref in (by_name.get("REDISCLI_AUTH"), by_name.get("RADIXSERVE_OPERATOR_REDIS_PASSWORD"))
    assert (
        "maxmemory-policy allkeys-lru" in one(docs, "ConfigMap", "rs-radixserve-redis")["data"]["redis.conf"]
    )


def test_schema_rejects_an_unknown_eviction_policy(helm_env: dict[str, str]) -> None:
    with pytest.raises(AssertionError, match="maxmemoryPolicy"):
        render(helm_env, "--set", "redis.maxmemoryPolicy=evict-everything")


URL_WITH_PASSWORD = re.compile(r"rediss?://[^/\s]*:[^@/\s]+@")


@pytest.mark.parametrize("values", [[], NON_DEFAULT], ids=["default", "non-default"])
def test_redis_credentials_reach_containers_only_through_secrets(
    helm_env: dict[str, str], values: list[str]
) -> None:
    docs = render(helm_env, *values)
    for c in containers(docs):
        for e in c.get("env", []):
            assert not URL_WITH_PASSWORD.search(str(e.get("value", ""))), e
            if "PASSWORD" in e["name"] or e["name"] == "REDISCLI_AUTH":
                assert set(e["valueFrom"]) == {"secretKeyRef"}, e
    op = one(docs, "Deployment", "rs-radixserve-operator")["spec"]["template"]["spec"]["containers"][0]
    names = {e["name"] for e in op["env"]}
    assert ("RADIXSERVE_OPERATOR_REDIS_PASSWORD" in names) == (values == [])  # only with the chart's Redis


def _rules(docs: list[Doc], kind: str, name: str) -> list[Doc]:
    return list(one(docs, kind, name)["rules"])


def _reads_secrets(rule: Doc) -> bool:
    return (
        "" in rule["apiGroups"]
        and bool({"secrets", "*"} & set(rule["resources"]))
        and bool({"get", "list", "watch", "*"} & set(rule["verbs"]))
    )


@pytest.mark.parametrize(
    "values",
    [[], NON_DEFAULT, ["--set", "rbac.secretReadNamespaces={ml}"]],
    ids=["cluster-wide", "two-namespaces", "extra-reader"],
)
def test_no_cluster_wide_secret_reads_and_finalizer_updates(
    helm_env: dict[str, str], values: list[str]
) -> None:
    docs = render(helm_env, *values)
    validate_all(docs)
    cluster_bound = {d["roleRef"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding"}
    for role in cluster_bound:
        for rule in _rules(docs, "ClusterRole", role):
            assert not (_reads_secrets(rule) and not rule.get("resourceNames")), rule
    rules = _rules(docs, "ClusterRole", "rs-radixserve-operator")
    grants = {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert ("radixserve.io", "inferenceservices/finalizers", "update") in grants
    assert ("radixserve.io", "gpunodepools/finalizers", "update") in grants
    # Secrets are read only where a RoleBinding lets it: the watched namespaces, the extra ones.
    bindings = {d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding"}
    expected = {"ml", "staging"} if values == NON_DEFAULT else ({"ml"} if values else set())
    assert bindings == expected
    for d in docs:
        if d["kind"] == "RoleBinding":
            assert d["roleRef"]["name"] == "rs-radixserve-operator-secret-reader"
            assert d["subjects"][0]["namespace"] == "serving"
    if expected:
        (rule,) = _rules(docs, "ClusterRole", "rs-radixserve-operator-secret-reader")
        assert rule["resources"] == ["secrets"] and rule["verbs"] == ["get"]


def test_every_rbac_rule_names_what_needs_it() -> None:

    lines = (CHART / "templates" / "rbac.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- apiGroups:"):
            assert lines[i - 1].strip().startswith("#"), f"rbac.yaml:{i + 1}: say which handler needs it"


def test_network_policies_for_redis_and_the_operator(helm_env: dict[str, str]) -> None:
    docs = render(helm_env)
    redis = one(docs, "NetworkPolicy", "rs-radixserve-redis")["spec"]
    assert redis["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    assert redis["policyTypes"] == ["Ingress", "Egress"] and redis["egress"] == []
    (rule,) = redis["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    operator, services = rule["from"]
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert "namespaceSelector" not in operator  # the operator's pod, in the release namespace
    assert services == {
        "namespaceSelector": {},
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "radixserve",
                "app.kubernetes.io/managed-by": "radixserve-operator",
            }
        },
    }
    op = one(docs, "NetworkPolicy", "rs-radixserve-operator")["spec"]
    assert op["ingress"] == []
    ports = [sorted(p["port"] for p in rule["ports"]) for rule in op["egress"]]
    assert ports == [[53, 53], [443, 6443], [6379]]
    # The operator hands the same Redis peer to the services' policies.
    env = {e["name"]: e.get("value") for e in one(docs, "Deployment", "rs-radixserve-operator")["spec"][
        "template"]["spec"]["containers"][0]["env"]}  # fmt: skip
    peer = json.loads(env["RADIXSERVE_OPERATOR_REDIS_PEER"])
    assert peer["podSelector"] == redis["podSelector"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "serving"}}
    assert env["RADIXSERVE_OPERATOR_MONITORING_NAMESPACE"] == "monitoring"


def test_network_policies_follow_the_values(helm_env: dict[str, str]) -> None:
    docs = render(
        helm_env,
        *("--set", "operator.watchNamespaces={ml}", "--set", "networkPolicy.apiServer.cidrs={10.0.0.1/32}"),
        *("--set-json", 'networkPolicy.gatewayFrom=[{"namespaceSelector":{"matchLabels":{"team":"web"}}}]'),
    )
    validate_all(docs)
    services = one(docs, "NetworkPolicy", "rs-radixserve-redis")["spec"]["ingress"][0]["from"][1]
    assert services["namespaceSelector"] == {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml"]}]
    }
    api = one(docs, "NetworkPolicy", "rs-radixserve-operator")["spec"]["egress"][1]
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    op = one(docs, "Deployment", "rs-radixserve-operator")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in op["env"]}
    assert json.loads(env["RADIXSERVE_OPERATOR_GATEWAY_FROM"]) == [
        {"namespaceSelector": {"matchLabels": {"team": "web"}}}
    ]
    off = render(helm_env, "--set", "networkPolicy.enabled=false")
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]
    op = one(off, "Deployment", "rs-radixserve-operator")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "RADIXSERVE_OPERATOR_NETWORK_POLICY", "value": "false"} in op["env"]


def test_the_charts_inference_service_asks_for_an_api_key(helm_env: dict[str, str]) -> None:
    docs = render(helm_env, "--set", "inferenceService.create=true")
    validate_all(docs)
    isvc = one(docs, "InferenceService", "llm")
    assert isvc["spec"]["auth"] == {"apiKeySecretRef": {"name": "llm-api-keys", "key": "api-keys"}}
    key = base64.b64decode(one(docs, "Secret", "llm-api-keys")["data"]["api-keys"]).decode()
    assert key.startswith("rs-") and len(key) > 40
    # A Secret of the user's: referenced, not made.
    docs = render(
        helm_env, "--set", "inferenceService.create=true", "--set", "inferenceService.apiKeys.secretName=k"
    )
    assert one(docs, "InferenceService", "llm")["spec"]["auth"]["apiKeySecretRef"]["name"] == "k"
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("api-keys")]
    # Off, or the spec's own auth wins.
    docs = render(
        helm_env, "--set", "inferenceService.create=true", "--set", "inferenceService.apiKeys.generate=false"
    )
    assert "auth" not in one(docs, "InferenceService", "llm")["spec"]
    own = ["--set", "inferenceService.create=true", "--set", "inferenceService.spec.auth.protectMetrics=true"]
    docs = render(helm_env, *own)
    assert one(docs, "InferenceService", "llm")["spec"]["auth"] == {"protectMetrics": True}
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("api-keys")]


def test_lint_strict_with_the_security_values(helm_env: dict[str, str]) -> None:
    helm(
        helm_env, "lint", "--strict", str(CHART),
        "--set", "redis.auth.existingSecret=my-redis", "--set", "rbac.secretReadNamespaces={ml}",
        "--set", "networkPolicy.enabled=false", "--set", "inferenceService.create=true",
    )  # fmt: skip
