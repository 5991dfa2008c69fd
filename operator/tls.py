"""TLS for an InferenceService's pods: gRPC between them (``spec.tls``) and an external Redis's CA
(``spec.redis.caSecretRef``).

    spec.tls.secretName      a kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt) every pod mounts
    spec.tls.certManager     instead: the operator renders a cert-manager Certificate NAME-grpc-tls
                             (cert-manager.io/v1) that writes that Secret, for every name the pods
                             are dialed by and the server name
    spec.tls.clientAuth      mutual TLS: every gRPC port wants a client certificate from the CA
    spec.tls.serverName      the name checked in server certificates (pods dial each other by IP
                             too); default NAME.NAMESPACE.svc, which the certificate must hold

Kubernetes' gRPC probes speak plaintext only: with TLS on, they become exec probes running
``python -m radixserve.common.health 127.0.0.1:PORT`` with the pod's own TLS settings.
"""

from __future__ import annotations

from radixserve.operator.objects import Obj
from radixserve.operator.volumes import SECRET_FILE_MODE

TLS_DIR = "/etc/radixserve/tls"
REDIS_CA_DIR = "/etc/radixserve/redis-ca"
REDIS_CA_FILE = f"{REDIS_CA_DIR}/ca.crt"
REDIS_CA_DEFAULT_KEY = "ca.crt"
# The env var a pod's Redis URL (from the user's Secret) lands in before RADIXSERVE_PREFIX_INDEX adds
# the CA to it ($(VAR) expansion): not a RADIXSERVE_* name, so no service reads it as a setting.
REDIS_URL_VAR = "REDIS_URL_FROM_SECRET"
CERT_MANAGER_API = "cert-manager.io/v1"
COMPONENTS = ("gateway", "scheduler", "detokenizer")

_SECRET_KEY = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1}, "key": {"type": "string"}},
    "required": ["name"],
}
TLS_SCHEMA: Obj = {
    "type": "object",
    "description": "gRPC between the pods over TLS: exactly one of secretName or certManager.",
    "properties": {
        "secretName": {
            "type": "string",
            "minLength": 1,
            "description": "a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt (the CA that "
            "signed every pod's certificate); it must hold serverName",
        },
        "certManager": {
            "type": "object",
            "description": "the operator renders a cert-manager Certificate NAME-grpc-tls from this issuer",
            "properties": {
                "issuerRef": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "kind": {"type": "string", "default": "Issuer", "enum": ["Issuer", "ClusterIssuer"]},
                        "group": {"type": "string", "default": "cert-manager.io"},
                    },
                    "required": ["name"],
                },
            },
            "required": ["issuerRef"],
        },
        "clientAuth": {"type": "boolean", "default": False, "description": "mutual TLS"},
        "serverName": {
            "type": "string",
            "description": "the name checked in server certificates; default NAME.NAMESPACE.svc",
        },
    },
    "x-kubernetes-validations": [
        {
            "rule": "has(self.secretName) != has(self.certManager)",
            "message": "spec.tls needs exactly one of secretName or certManager",
        }
    ],
}
REDIS_CA_SCHEMA: Obj = _SECRET_KEY | {
    "description": "redis.mode external over rediss://: the CA (PEM) that signed the Redis server's "
    'certificate, in this Secret key (default "ca.crt"); the URL must have no query string',
}


def enabled(spec: Obj) -> bool:
    return bool(spec.get("tls"))


def problems(spec: Obj) -> list[str]:
    """What the schema's CEL rule says, for a spec that reached the operator anyway."""
    out = []
    tls = spec.get("tls")
    if tls and bool(tls.get("secretName")) == bool(tls.get("certManager")):
        out.append("spec.tls needs exactly one of secretName or certManager")
    redis = spec["redis"]
    if redis.get("caSecretRef") and redis["mode"] != "external":
        out.append("redis.caSecretRef is for redis.mode external (the chart's Redis is plaintext)")
    return out


def certificate_name(name: str) -> str:
    return f"{name}-grpc-tls"


def secret_name(name: str, spec: Obj) -> str:
    tls = spec["tls"]
    return str(tls.get("secretName") or certificate_name(name))


def server_name(name: str, namespace: str, spec: Obj) -> str:
    return str(spec["tls"].get("serverName") or f"{name}.{namespace}.svc")


def dns_names(name: str, namespace: str, spec: Obj) -> list[str]:
    """Every name a pod of the service is dialed by (the schedulers by their pod's DNS record), and
    the server name (what a dial by IP checks)."""
    names = [server_name(name, namespace, spec), f"*.{name}-scheduler.{namespace}.svc"]
    for component in COMPONENTS:
        host = f"{name}-{component}.{namespace}.svc"
        names += [host, f"{host}.cluster.local"]
    return list(dict.fromkeys(names))


def certificate(name: str, namespace: str, spec: Obj, labels: dict[str, str]) -> Obj | None:
    """The cert-manager Certificate behind the service's TLS Secret: only with spec.tls.certManager."""
    tls = spec.get("tls") or {}
    if not tls.get("certManager"):
        return None
    issuer = tls["certManager"]["issuerRef"]
    return {
        "apiVersion": CERT_MANAGER_API,
        "kind": "Certificate",
        "metadata": {"name": certificate_name(name), "namespace": namespace, "labels": labels},
        "spec": {
            "secretName": certificate_name(name),
            "commonName": server_name(name, namespace, spec),
            "dnsNames": dns_names(name, namespace, spec),
            "usages": ["digital signature", "key encipherment", "server auth", "client auth"],
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "issuerRef": {
                "name": issuer["name"],
                "kind": issuer.get("kind") or "Issuer",
                "group": issuer.get("group") or "cert-manager.io",
            },
        },
    }


def _mount(pod: Obj, container: Obj, volume: Obj, path: str) -> None:
    """New lists: the init container shares the old ones and needs none of this."""
    pod["volumes"] = [*pod.get("volumes", []), volume]
    container["volumeMounts"] = [
        *container.get("volumeMounts", []),
        {"name": volume["name"], "mountPath": path, "readOnly": True},
    ]


def add_grpc_tls(pod: Obj, container: Obj, name: str, namespace: str, spec: Obj) -> None:
    """Mount the service's TLS Secret in ``container`` of ``pod`` and point RADIXSERVE_TLS_* at it."""
    items = [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")]
    secret = {"secretName": secret_name(name, spec), "items": items, "defaultMode": SECRET_FILE_MODE}
    _mount(pod, container, {"name": "grpc-tls", "secret": secret}, TLS_DIR)
    env = {
        "RADIXSERVE_TLS_CERT": f"{TLS_DIR}/tls.crt",
        "RADIXSERVE_TLS_KEY": f"{TLS_DIR}/tls.key",
        "RADIXSERVE_TLS_CA": f"{TLS_DIR}/ca.crt",
        "RADIXSERVE_TLS_SERVER_NAME": server_name(name, namespace, spec),
    }
    if spec["tls"].get("clientAuth"):
        env["RADIXSERVE_TLS_CLIENT_AUTH"] = "true"
    container["env"] = [*container.get("env", []), *({"name": k, "value": v} for k, v in env.items())]


def exec_probes(probes: Obj, port: int) -> Obj:
    """``probes`` (grpc_probes) as exec probes of the health command: same timings and thresholds."""
    command = ["python", "-m", "radixserve.common.health", f"127.0.0.1:{port}", "--timeout", "3"]
    out = {}
    for kind, probe in probes.items():
        rest = {k: v for k, v in probe.items() if k != "grpc"}
        service = probe["grpc"].get("service")
        # An exec probe's own timeout (default 1 s) must cover the Python start and the check.
        argv = [*command, "--service", service] if service else command
        out[kind] = {"exec": {"command": argv}, "timeoutSeconds": 5, **rest}
    return out


def add_redis_ca(pod: Obj, container: Obj, ref: Obj) -> str:
    """Mount the external Redis's CA (Secret key ``ref``); the file's path."""
    item = {"key": ref.get("key") or REDIS_CA_DEFAULT_KEY, "path": REDIS_CA_FILE.rsplit("/", 1)[1]}
    secret = {"secretName": ref["name"], "items": [item], "defaultMode": SECRET_FILE_MODE}
    _mount(pod, container, {"name": "redis-ca", "secret": secret}, REDIS_CA_DIR)
    return REDIS_CA_FILE


def with_ca(url: str, ca_file: str) -> str:
    """``url`` with ``ssl_ca_certs=ca_file`` added (a rediss:// URL without one); else unchanged."""
    if not ca_file or not url.startswith("rediss://") or "ssl_ca_certs=" in url:
        return url
    return f"{url}{'&' if '?' in url else '?'}ssl_ca_certs={ca_file}"
