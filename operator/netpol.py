"""NetworkPolicies for one InferenceService's pods: pure builders, applied with the other children.

    NAME-gateway      ingress  HTTP + gRPC from spec.networkPolicy.gatewayFrom (else the operator's
                               default, else every pod of the service's namespace); gRPC from the
                               service's own pods (the detokenizer delivers there); the HTTP port
                               (it serves /metrics) from the monitoring namespace
    NAME-scheduler    ingress  gRPC from the service's own pods only; metrics from monitoring
    NAME-detokenizer  ingress  gRPC from the service's own pods only; metrics from monitoring
    all three         egress   DNS (port 53 to any address: node-local DNS caches live outside
                               kube-system), the service's own pods, its Redis (chart: the Redis
                               pod; external: any address on 6379/6380), the OTLP collector's port
                               (tracing), 443 to any address when the model comes from the Hugging
                               Face Hub (the init container downloads it), and
                               spec.networkPolicy.extraEgress (an external Redis elsewhere, ...)

Kubelet probes come from the node and are not subject to these in the common CNIs. Policies add
up: another policy selecting the same pods can only allow more.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from radixserve.operator import volumes
from radixserve.operator.manifests import (
    DETOKENIZER_METRICS_PORT,
    DETOKENIZER_PORT,
    GATEWAY_GRPC_PORT,
    GATEWAY_HTTP_PORT,
    SCHEDULER_METRICS_PORT,
    SCHEDULER_PORT,
    BuildContext,
    _meta,
    selector,
)
from radixserve.operator.objects import Obj

COMPONENTS = ("gateway", "scheduler", "detokenizer")
REDIS_PORT = 6379
EXTERNAL_REDIS_PORTS = (6379, 6380)  # plain and the usual TLS port
HTTPS_PORT = 443
OTLP_GRPC_PORT = 4317


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """The operator's defaults (the chart sets them): a spec's ``networkPolicy`` overrides."""

    enabled: bool = False
    monitoring_namespace: str = ""  # may scrape the metrics ports; empty: nobody outside
    gateway_from: tuple[Obj, ...] = ()  # NetworkPolicyPeers; empty: the service's namespace
    redis_peer: Obj | None = None  # the chart's Redis pods; None: any address on 6379


def enabled(spec: Obj, settings: PolicySettings) -> bool:
    given = (spec.get("networkPolicy") or {}).get("enabled")
    return settings.enabled if given is None else bool(given)


def _tcp(*ports: int) -> list[Obj]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _own_pods(ctx: BuildContext) -> Obj:
    labels = selector(ctx, "gateway")
    labels.pop("app.kubernetes.io/component")
    return {"podSelector": {"matchLabels": labels}}


def _monitoring(settings: PolicySettings, port: int) -> list[Obj]:
    if not settings.monitoring_namespace:
        return []
    ns = {"matchLabels": {"kubernetes.io/metadata.name": settings.monitoring_namespace}}
    return [{"from": [{"namespaceSelector": ns}], "ports": _tcp(port)}]


def _ingress(ctx: BuildContext, settings: PolicySettings, component: str) -> list[Obj]:
    own = [_own_pods(ctx)]
    if component == "gateway":
        peers = (ctx.spec.get("networkPolicy") or {}).get("gatewayFrom") or list(settings.gateway_from)
        clients = peers or [{"podSelector": {}}]  # every pod of this namespace
        return [
            {"from": clients, "ports": _tcp(GATEWAY_HTTP_PORT, GATEWAY_GRPC_PORT)},
            {"from": own, "ports": _tcp(GATEWAY_GRPC_PORT)},
            *_monitoring(settings, GATEWAY_HTTP_PORT),
        ]
    if component == "scheduler":
        return [{"from": own, "ports": _tcp(SCHEDULER_PORT)}, *_monitoring(settings, SCHEDULER_METRICS_PORT)]
    return [{"from": own, "ports": _tcp(DETOKENIZER_PORT)}, *_monitoring(settings, DETOKENIZER_METRICS_PORT)]


def _port_of(url: str, default: int) -> int:
    try:
        return urlsplit(url if "//" in url else f"//{url}").port or default
    except ValueError:
        return default


def egress(ctx: BuildContext, settings: PolicySettings) -> list[Obj]:
    spec = ctx.spec
    dns = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    rules: list[Obj] = [{"ports": dns}, {"to": [_own_pods(ctx)]}]
    mode = spec["redis"]["mode"]
    if mode == "chart":
        to = [settings.redis_peer] if settings.redis_peer else []
        rules.append({**({"to": to} if to else {}), "ports": _tcp(REDIS_PORT)})
    elif mode == "external":
        rules.append({"ports": _tcp(*EXTERNAL_REDIS_PORTS)})
    if volumes.downloaded(spec) is not None:  # the Hub, S3, GCS over HTTPS (another port: extraEgress)
        rules.append({"ports": _tcp(HTTPS_PORT)})
    endpoint = spec["tracing"].get("otlpEndpoint")
    if endpoint:
        rules.append({"ports": _tcp(_port_of(endpoint, OTLP_GRPC_PORT))})
    rules += (spec.get("networkPolicy") or {}).get("extraEgress") or []
    return rules


def policy(ctx: BuildContext, settings: PolicySettings, component: str) -> Obj:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(ctx, component, component),
        "spec": {
            "podSelector": {"matchLabels": selector(ctx, component)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": _ingress(ctx, settings, component),
            "egress": egress(ctx, settings),
        },
    }


def build(ctx: BuildContext, settings: PolicySettings) -> list[Obj]:
    """The service's NetworkPolicies; none when they are off for it."""
    if not enabled(ctx.spec, settings):
        return []
    return [policy(ctx, settings, c) for c in COMPONENTS]
