"""The operator's security pieces, pure: per-service Redis credentials, NetworkPolicies, API keys."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import pytest

from radixserve.operator import netpol, redis_acl
from radixserve.operator.config import OperatorConfig
from radixserve.operator.manifests import build_all
from radixserve.operator.netpol import PolicySettings
from radixserve.operator.redis_acl import ChartRedis
from tests.operator.specs import SPEC, ctx

CHART = ChartRedis("redis://rs-radixserve-redis.serving.svc:6379/0", "admin", "admin-password")
REDIS_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "serving"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "redis"}},
}
POLICIES = PolicySettings(enabled=True, monitoring_namespace="monitoring", redis_peer=REDIS_PEER)
OWN_PODS = {
    "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "radixserve", "app.kubernetes.io/instance": "llm"}
    }
}
DNS = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


def workloads(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] in ("Deployment", "StatefulSet")}


def env_of(workload: dict[str, Any]) -> dict[str, Any]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# --------------------------------------------------------------------------- Redis credentials
def test_each_service_has_its_own_user_prefix_and_a_stable_derived_password() -> None:
    user, password, url = CHART.service_credentials("prod", "llm")
    assert user == "rs-prod.llm" and len(password) == 64
    assert url == f"redis://rs-prod.llm:{password}@rs-radixserve-redis.serving.svc:6379/0"
    assert redis_acl.key_prefix("prod", "llm") == "rs:prod/llm:"
    assert CHART.service_credentials("prod", "llm") == (user, password, url)  # every round the same
    assert password not in {
        CHART.service_credentials("prod", "llm2")[1],
        CHART.service_credentials("dev", "llm")[1],
        dataclasses.replace(CHART, admin_password="another").service_credentials("prod", "llm")[1],
    }
    # A dash could join differently (a-b/c, a/b-c); a namespace has no dot, so a dot cannot.
    assert redis_acl.user_name("a-b", "c") != redis_acl.user_name("a", "b-c")
    assert CHART.admin_url == "redis://admin:admin-password@rs-radixserve-redis.serving.svc:6379/0"
    assert redis_acl.with_credentials("rediss://old:pw@h:6380/1?ssl_ca_certs=/ca.pem", "u", "p/w") == (
        "rediss://u:p%2Fw@h:6380/1?ssl_ca_certs=/ca.pem"
    )


def test_the_credentials_secret_is_immutable_and_named_by_its_contents() -> None:
    secret = redis_acl.credentials_secret(CHART, "prod", "llm", {"app.kubernetes.io/instance": "llm"})
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    user, password, url = CHART.service_credentials("prod", "llm")
    assert data == {"username": user, "password": password, "url": url}
    assert secret["immutable"] is True and secret["metadata"]["namespace"] == "prod"
    name = secret["metadata"]["name"]
    assert name.startswith("llm-redis-") and name == redis_acl.credentials_secret(CHART, "prod", "llm", {})[
        "metadata"]["name"]  # fmt: skip
    moved = dataclasses.replace(CHART, url="redis://elsewhere:6379/0")
    assert redis_acl.credentials_secret(moved, "prod", "llm", {})["metadata"]["name"] != name


def test_every_pod_reads_the_redis_url_from_the_services_secret() -> None:
    objs = build_all(dataclasses.replace(ctx(), redis_secret="llm-redis-0123456789"))
    ref = {"secretKeyRef": {"name": "llm-redis-0123456789", "key": "url"}}
    by_name = workloads(objs)
    assert env_of(by_name["llm-gateway"])["RADIXSERVE_PREFIX_INDEX"] == ref
    assert env_of(by_name["llm-scheduler"])["RADIXSERVE_PREFIX_INDEX"] == ref
    assert "RADIXSERVE_PREFIX_INDEX" not in env_of(by_name["llm-detokenizer"])
    config = next(o for o in objs if o["kind"] == "ConfigMap")
    assert config["data"]["RADIXSERVE_INDEX_KEY_PREFIX"] == "rs:prod/llm:"
    # An external Redis: its own Secret; its keys under the same per-service prefix.
    ext = build_all(ctx({**SPEC, "redis": {"mode": "external", "urlSecretRef": {"name": "u", "key": "k"}}}))
    assert env_of(workloads(ext)["llm-gateway"])["RADIXSERVE_PREFIX_INDEX"] == {
        "secretKeyRef": {"name": "u", "key": "k"}
    }
    assert (
        next(o for o in ext if o["kind"] == "ConfigMap")["data"]["RADIXSERVE_INDEX_KEY_PREFIX"]
        == "rs:prod/llm:"
    )
    none = build_all(ctx({**SPEC, "redis": {"mode": "none"}}))
    assert "RADIXSERVE_INDEX_KEY_PREFIX" not in next(o for o in none if o["kind"] == "ConfigMap")["data"]


def test_operator_config_from_the_charts_environment() -> None:
    env = {
        "RADIXSERVE_OPERATOR_REDIS_URL": "redis://r:6379/0",
        "RADIXSERVE_OPERATOR_REDIS_USER": "admin",
        "RADIXSERVE_OPERATOR_REDIS_PASSWORD": "pw",
        "RADIXSERVE_OPERATOR_NETWORK_POLICY": "true",
        "RADIXSERVE_OPERATOR_MONITORING_NAMESPACE": "monitoring",
        "RADIXSERVE_OPERATOR_GATEWAY_FROM": '[{"namespaceSelector": {}}]',
        "RADIXSERVE_OPERATOR_REDIS_PEER": json.dumps(REDIS_PEER),
    }
    config = OperatorConfig.from_env(env)
    assert config.chart_redis == ChartRedis("redis://r:6379/0", "admin", "pw")
    assert config.policies == PolicySettings(True, "monitoring", ({"namespaceSelector": {}},), REDIS_PEER)
    assert "pw" not in repr(config)
    bare = OperatorConfig.from_env({"RADIXSERVE_OPERATOR_REDIS_URL": "redis://r:6379/0"})
    assert bare.chart_redis is None and bare.policies == PolicySettings()  # a Redis without ACLs


# ----------------------------------------------------------------------------- NetworkPolicies
def policies(spec: dict[str, Any] = SPEC, settings: PolicySettings = POLICIES) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p["spec"] for p in netpol.build(ctx(spec), settings)}


def test_schedulers_and_detokenizers_take_only_their_own_services_pods() -> None:
    by_name = policies()
    assert sorted(by_name) == ["llm-detokenizer", "llm-gateway", "llm-scheduler"]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    for name, port, metrics in [("llm-scheduler", 50051, 9400), ("llm-detokenizer", 50052, 9401)]:
        spec = by_name[name]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "llm"
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        assert spec["ingress"] == [
            {"from": [OWN_PODS], "ports": [{"protocol": "TCP", "port": port}]},
            {"from": [monitoring], "ports": [{"protocol": "TCP", "port": metrics}]},
        ]


def test_the_gateway_takes_its_namespace_unless_told_otherwise() -> None:
    gateway = policies()["llm-gateway"]["ingress"]
    api = [{"protocol": "TCP", "port": 8000}, {"protocol": "TCP", "port": 50050}]
    assert gateway[0] == {"from": [{"podSelector": {}}], "ports": api}
    assert gateway[1] == {"from": [OWN_PODS], "ports": [{"protocol": "TCP", "port": 50050}]}
    assert gateway[2]["ports"] == [{"protocol": "TCP", "port": 8000}]  # /metrics is on the HTTP port
    ingress_nginx = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    operator_wide = dataclasses.replace(POLICIES, gateway_from=(ingress_nginx,))
    assert policies(settings=operator_wide)["llm-gateway"]["ingress"][0]["from"] == [ingress_nginx]
    team = [{"podSelector": {"matchLabels": {"team": "web"}}}]
    own = {**SPEC, "networkPolicy": {"gatewayFrom": team}}
    assert policies(own, operator_wide)["llm-gateway"]["ingress"][0]["from"] == team
    # No monitoring namespace: nobody scrapes from outside.
    quiet = policies(settings=dataclasses.replace(POLICIES, monitoring_namespace=""))
    assert len(quiet["llm-gateway"]["ingress"]) == 2 and len(quiet["llm-scheduler"]["ingress"]) == 1


def test_egress_is_dns_own_pods_redis_and_what_the_spec_needs() -> None:
    redis = {"to": [REDIS_PEER], "ports": [{"protocol": "TCP", "port": 6379}]}
    otlp = {"ports": [{"protocol": "TCP", "port": 4317}]}  # SPEC traces to http://otel:4317
    assert policies()["llm-scheduler"]["egress"] == [DNS, {"to": [OWN_PODS]}, redis, otlp]
    hub = {"model": {"source": {"hub": {"id": "org/m"}}}, "scheduler": {"device": "cpu", "gpusPerReplica": 0}}
    https = {"ports": [{"protocol": "TCP", "port": 443}]}
    assert policies(hub)["llm-gateway"]["egress"] == [DNS, {"to": [OWN_PODS]}, redis, https]
    extra = {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 7000}]}
    ext = {
        **SPEC,
        "redis": {"mode": "external", "urlSecretRef": {"name": "u"}},
        "networkPolicy": {"extraEgress": [extra]},
    }
    egress = policies(ext)["llm-detokenizer"]["egress"]
    assert egress[2] == {"ports": [{"protocol": "TCP", "port": 6379}, {"protocol": "TCP", "port": 6380}]}
    assert egress[-1] == extra
    anywhere = policies(settings=dataclasses.replace(POLICIES, redis_peer=None))["llm-scheduler"]["egress"][2]
    assert anywhere == {"ports": [{"protocol": "TCP", "port": 6379}]}
    none = policies({**SPEC, "redis": {"mode": "none"}, "tracing": {}})["llm-scheduler"]["egress"]
    assert none == [DNS, {"to": [OWN_PODS]}]


def test_policies_follow_the_operator_unless_the_spec_says() -> None:
    off = dataclasses.replace(POLICIES, enabled=False)
    assert policies(settings=off) == {}
    assert len(policies({**SPEC, "networkPolicy": {"enabled": True}}, off)) == 3
    assert policies({**SPEC, "networkPolicy": {"enabled": False}}) == {}


# ------------------------------------------------------------------------------------- API keys
def test_the_gateway_reads_api_keys_from_a_mounted_secret() -> None:
    spec = {**SPEC, "auth": {"apiKeySecretRef": {"name": "keys"}, "protectMetrics": True}}
    gateway = workloads(build_all(ctx(spec)))["llm-gateway"]
    pod = gateway["spec"]["template"]["spec"]
    env = env_of(gateway)
    assert env["RADIXSERVE_API_KEY_FILE"] == "/etc/radixserve/auth/api-keys"
    assert env["RADIXSERVE_PROTECT_METRICS"] == "true"
    assert {
        "name": "api-keys",
        "secret": {
            "secretName": "keys",
            "items": [{"key": "api-keys", "path": "api-keys"}],
            "defaultMode": 0o440,
        },
    } in pod["volumes"]
    mount = {"name": "api-keys", "mountPath": "/etc/radixserve/auth", "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"]
    others = workloads(build_all(ctx(spec)))
    for name in ("llm-scheduler", "llm-detokenizer"):  # only the gateway checks keys
        assert "RADIXSERVE_API_KEY_FILE" not in env_of(others[name])
    plain = env_of(workloads(build_all(ctx()))["llm-gateway"])
    assert "RADIXSERVE_API_KEY_FILE" not in plain and "RADIXSERVE_PROTECT_METRICS" not in plain


@pytest.mark.parametrize("version", ["1.28.0", "1.37.0"])
def test_security_objects_are_valid_kubernetes(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    extra = {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 7000}]}
    specs = [
        SPEC,
        {"model": {"source": {"hub": {"id": "org/m"}}}, "networkPolicy": {"extraEgress": [extra]}},
        {**SPEC, "auth": {"apiKeySecretRef": {"name": "keys", "key": "k"}}, "redis": {"mode": "none"}},
    ]
    for spec in specs:
        c = dataclasses.replace(ctx(spec), redis_secret="llm-redis-0123456789")
        for obj in [
            *netpol.build(c, POLICIES),
            *build_all(c),
            redis_acl.credentials_secret(CHART, "prod", "llm", {}),
        ]:
            kv.validate(obj, version, strict=True)
