"""spec.tls (gRPC between the pods over TLS, the Secret given or a cert-manager Certificate) and
spec.redis.caSecretRef (an external rediss:// Redis's CA): what the builders render, what the checks
refuse. Without either, nothing changes (test_manifests' exact manifests)."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.operator import tls
from radixserve.operator.crds import INFERENCE_SERVICE_SPEC
from radixserve.operator.handlers import _apply_children
from radixserve.operator.kube import KubeError
from radixserve.operator.manifests import BuildContext, build_all
from radixserve.operator.schema import apply_defaults, schema_problems
from radixserve.operator.validation import validate

CM = {"certManager": {"issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"}}}
HEALTH = ["python", "-m", "radixserve.common.health"]


def ctx(**spec: Any) -> BuildContext:
    return BuildContext(
        name="llm",
        namespace="prod",
        spec=apply_defaults(INFERENCE_SERVICE_SPEC, {"model": {"path": "demo"}, **spec}),
        image="img:1",
        scheduler_replicas=2,
        chart_redis_url="redis://r:6379/0",
    )


def pods(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component -> its pod spec."""
    return {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["spec"]
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
    }


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}


def test_a_tls_secret_is_mounted_in_every_pod_with_the_settings_and_exec_probes() -> None:
    plain = pods(build_all(ctx()))
    objs = build_all(ctx(tls={"secretName": "grpc-certs", "clientAuth": True}))
    assert all(o["kind"] != "Certificate" for o in objs)
    ports = {"scheduler": 50051, "detokenizer": 50052}
    for component, pod in pods(objs).items():
        (c,) = pod["containers"]
        assert {"name": "grpc-tls", "mountPath": "/etc/radixserve/tls", "readOnly": True} in c["volumeMounts"]
        volume = next(v for v in pod["volumes"] if v["name"] == "grpc-tls")
        assert volume["secret"]["secretName"] == "grpc-certs"
        assert {i["key"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
        assert {k: v for k, v in env(pod).items() if k.startswith("RADIXSERVE_TLS_")} == {
            "RADIXSERVE_TLS_CERT": "/etc/radixserve/tls/tls.crt",
            "RADIXSERVE_TLS_KEY": "/etc/radixserve/tls/tls.key",
            "RADIXSERVE_TLS_CA": "/etc/radixserve/tls/ca.crt",
            "RADIXSERVE_TLS_SERVER_NAME": "llm.prod.svc",
            "RADIXSERVE_TLS_CLIENT_AUTH": "true",
        }
        # The init container (none here) and other mounts are untouched; the old pod had none of it.
        assert not [m for m in plain[component]["containers"][0]["volumeMounts"] if m["name"] == "grpc-tls"]
        before = plain[component]["containers"][0]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if component == "gateway":  # HTTP probes: the HTTP port is not gRPC
                assert c[kind] == before[kind]
                continue
            probe = dict(c[kind])
            # The scheduler's liveness asks its "liveness" health service, through the command too.
            service = ["--service", "liveness"] if (component, kind) == ("scheduler", "livenessProbe") else []
            assert probe.pop("exec") == {
                "command": [*HEALTH, f"127.0.0.1:{ports[component]}", "--timeout", "3", *service]
            }
            assert probe.pop("timeoutSeconds") == 5
            old = dict(before[kind])
            grpc = {"port": ports[component], **({"service": "liveness"} if service else {})}
            assert old.pop("grpc") == grpc
            assert probe == old  # the same period and thresholds


def test_server_name_is_the_spec_s_when_given() -> None:
    objs = build_all(ctx(tls={"secretName": "s", "serverName": "grpc.internal"}))
    for pod in pods(objs).values():
        assert env(pod)["RADIXSERVE_TLS_SERVER_NAME"] == "grpc.internal"
        assert "RADIXSERVE_TLS_CLIENT_AUTH" not in env(pod)


def test_cert_manager_renders_a_certificate_for_every_name_and_its_secret_is_used() -> None:
    objs = build_all(ctx(tls=CM))
    cert = objs[0]  # first: before the pods that mount its Secret
    assert cert["apiVersion"] == "cert-manager.io/v1" and cert["kind"] == "Certificate"
    assert cert["metadata"]["name"] == "llm-grpc-tls" and cert["metadata"]["namespace"] == "prod"
    spec = cert["spec"]
    assert spec["secretName"] == "llm-grpc-tls"
    assert spec["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert {
        "llm.prod.svc",  # the server name every pod checks (dials by IP)
        "*.llm-scheduler.prod.svc",  # what each scheduler advertises
        "llm-gateway.prod.svc",
        "llm-scheduler.prod.svc",
        "llm-detokenizer.prod.svc",
    } <= set(spec["dnsNames"])
    for pod in pods(objs).values():
        assert env(pod)["RADIXSERVE_TLS_SERVER_NAME"] in spec["dnsNames"]
        volume = next(v for v in pod["volumes"] if v["name"] == "grpc-tls")
        assert volume["secret"]["secretName"] == "llm-grpc-tls"
    named = build_all(ctx(tls={**CM, "serverName": "grpc.internal"}))[0]
    assert "grpc.internal" in named["spec"]["dnsNames"]


def test_without_tls_nothing_is_added() -> None:
    objs = build_all(ctx())
    assert [o["kind"] for o in objs if o["kind"] == "Certificate"] == []
    text = repr(objs)
    assert "RADIXSERVE_TLS" not in text and "radixserve.common.health" not in text and "grpc-tls" not in text


def test_external_redis_ca_is_mounted_and_named_in_the_url() -> None:
    redis = {"mode": "external", "urlSecretRef": {"name": "redis-url"}, "caSecretRef": {"name": "redis-ca"}}
    built = pods(build_all(ctx(redis=redis)))
    assert all(v["name"] != "redis-ca" for v in built.pop("detokenizer")["volumes"])  # dials no Redis
    for pod in built.values():
        e = env(pod)
        names = [x["name"] for x in pod["containers"][0]["env"]]
        # $(VAR) expands only variables defined earlier in the list.
        assert names.index(tls.REDIS_URL_VAR) < names.index("RADIXSERVE_PREFIX_INDEX")
        assert e[tls.REDIS_URL_VAR] == {"secretKeyRef": {"name": "redis-url", "key": "url"}}
        assert e["RADIXSERVE_PREFIX_INDEX"] == (
            "$(REDIS_URL_FROM_SECRET)?ssl_ca_certs=/etc/radixserve/redis-ca/ca.crt"
        )
        volume = next(v for v in pod["volumes"] if v["name"] == "redis-ca")
        assert volume["secret"]["secretName"] == "redis-ca"
        assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_the_operator_adds_its_ca_only_to_rediss_urls_without_one() -> None:
    assert tls.with_ca("rediss://h:6379/0", "/ca.pem") == "rediss://h:6379/0?ssl_ca_certs=/ca.pem"
    assert (
        tls.with_ca("rediss://h/0?ssl_certfile=/c", "/ca.pem")
        == "rediss://h/0?ssl_certfile=/c&ssl_ca_certs=/ca.pem"
    )
    assert tls.with_ca("rediss://h/0?ssl_ca_certs=/x", "/ca.pem") == "rediss://h/0?ssl_ca_certs=/x"
    assert tls.with_ca("redis://h/0", "/ca.pem") == "redis://h/0"
    assert tls.with_ca("rediss://h/0", "") == "rediss://h/0"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"tls": {"secretName": "s", **CM}}, "exactly one of secretName or certManager"),
        ({"tls": {"clientAuth": True}}, "exactly one of secretName or certManager"),
        ({"redis": {"mode": "chart", "caSecretRef": {"name": "ca"}}}, "redis.caSecretRef is for redis.mode"),
    ],
)
def test_contradictory_tls_specs_are_problems(spec: dict[str, Any], message: str) -> None:
    defaulted = apply_defaults(INFERENCE_SERVICE_SPEC, {"model": {"path": "demo"}, **spec})
    problems = validate(defaulted, None, "redis://r")
    assert [p.reason for p in problems] == ["InvalidSpec"] and message in problems[0].message


def test_the_schema_types_tls_and_says_the_rule_in_cel() -> None:
    base = {"model": {"path": "demo"}}
    assert (
        schema_problems(INFERENCE_SERVICE_SPEC, {**base, "tls": {"secretName": "s", "clientAuth": True}})
        == []
    )
    assert schema_problems(INFERENCE_SERVICE_SPEC, {**base, "tls": CM}) == []
    (bad,) = schema_problems(INFERENCE_SERVICE_SPEC, {**base, "tls": {"secretName": "s", "clientAth": True}})
    assert "spec.tls.clientAth: unknown field" in bad
    issuer = {"certManager": {"issuerRef": {"name": "x", "kind": "Nope"}}}
    assert schema_problems(INFERENCE_SERVICE_SPEC, {**base, "tls": issuer})
    (rule,) = INFERENCE_SERVICE_SPEC["properties"]["tls"]["x-kubernetes-validations"]
    assert rule["rule"] == "has(self.secretName) != has(self.certManager)"


class _NoCertManager:
    """A Kube whose API server has no cert-manager kinds."""

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Certificate":
            raise KubeError(404, "the server could not find the requested resource")
        return obj

    create = apply


def test_a_cluster_without_cert_manager_is_a_clear_problem() -> None:
    owner = {"apiVersion": "radixserve.io/v1alpha1", "kind": "InferenceService"}
    owner["metadata"] = {"name": "llm", "namespace": "prod", "uid": "u1"}  # type: ignore[assignment]
    problem = _apply_children(_NoCertManager(), owner, ctx(tls=CM))  # type: ignore[arg-type]
    assert problem is not None and problem.reason == "CertManagerMissing"
    assert "cert-manager" in problem.message
