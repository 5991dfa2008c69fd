"""A small synchronous Kubernetes REST client over the official client's transport and auth.

Handlers work with plain dicts (what the builders make), so this speaks raw JSON paths instead
of the generated typed models. kopf runs sync handlers in a thread pool, so blocking is fine.
"""

from __future__ import annotations

import json

from kubernetes import client, config

from radixserve.operator.manifests import Obj

FIELD_MANAGER = "radixserve-operator"
REQUEST_TIMEOUT = (5.0, 30.0)  # connect, read (s): a hung API call must not hold a kopf worker forever

# kind -> (API prefix, plural, namespaced) for every kind the operator touches.
KINDS: dict[str, tuple[str, str, bool]] = {
    "ConfigMap": ("api/v1", "configmaps", True),
    "Service": ("api/v1", "services", True),
    "Secret": ("api/v1", "secrets", True),
    "Pod": ("api/v1", "pods", True),
    "Node": ("api/v1", "nodes", False),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies", True),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets", True),
    "Deployment": ("apis/apps/v1", "deployments", True),
    "StatefulSet": ("apis/apps/v1", "statefulsets", True),
    "InferenceService": ("apis/radixserve.io/v1alpha1", "inferenceservices", True),
    "GPUNodePool": ("apis/radixserve.io/v1alpha1", "gpunodepools", False),
    "Certificate": ("apis/cert-manager.io/v1", "certificates", True),  # spec.tls.certManager only
}


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def path(kind: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural, namespaced = KINDS[kind]
    p = f"/{prefix}"
    if namespaced and namespace:
        p += f"/namespaces/{namespace}"
    p += f"/{plural}"
    if name:
        p += f"/{name}"
    if sub:
        p += f"/{sub}"
    return p


def load_config() -> None:
    """In-cluster service account first, then $KUBECONFIG / ~/.kube/config (tests, development)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class Kube:
    def __init__(self, api: client.ApiClient | None = None, user_agent: str = FIELD_MANAGER) -> None:
        self.api = api or client.ApiClient()
        self.api.user_agent = user_agent  # tells our requests apart in audit logs (and in tests)

    def request(
        self,
        method: str,
        url: str,
        body: Obj | None = None,
        query: dict[str, str] | None = None,
        content_type: str = "",
    ) -> Obj:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        query_params = list((query or {}).items())
        params = self.api.param_serialize(
            method,
            url,
            query_params=query_params,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(*params, _request_timeout=REQUEST_TIMEOUT)
        resp.read()
        text = resp.data.decode() if resp.data else ""
        if resp.status >= 400:
            raise KubeError(resp.status, text[:500])
        return json.loads(text) if text else {}

    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return self.request("GET", path(kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(
        self,
        kind: str,
        namespace: str | None = None,
        label_selector: str = "",
        labels: dict[str, str] | None = None,
    ) -> list[Obj]:
        """``labels``: exact label values, sent as the selector and checked here too (an emulator
        or a proxy may ignore the selector)."""
        if labels:
            label_selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        query = {"labelSelector": label_selector} if label_selector else None
        items = list(self.request("GET", path(kind, namespace), query=query).get("items", []))
        if not labels:
            return items
        return [
            o
            for o in items
            if all((o.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    def create(self, obj: Obj) -> Obj | None:
        """Create ``obj``; None when an object of that name exists already (left as it is)."""
        meta = obj["metadata"]
        try:
            return self.request(
                "POST", path(obj["kind"], meta.get("namespace")), obj, query={"fieldManager": FIELD_MANAGER}
            )
        except KubeError as e:
            if e.status == 409:
                return None
            raise

    def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        """Delete an object; False when there was none."""
        try:
            self.request("DELETE", path(kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    def merge_patch(
        self, kind: str, namespace: str | None, name: str, patch: Obj, sub: str | None = None
    ) -> Obj:
        return self.request(
            "PATCH", path(kind, namespace, name, sub), patch, content_type="application/merge-patch+json"
        )

    def apply(self, obj: Obj) -> Obj:
        """Server-side apply: we own exactly the fields we set, so a removed env var goes away too.

        Falls back to create where apply cannot create (API emulators without apply support).
        """
        meta = obj["metadata"]
        kind, ns, name = obj["kind"], meta.get("namespace"), meta["name"]
        query = {"fieldManager": FIELD_MANAGER, "force": "true"}
        try:
            return self.request(
                "PATCH", path(kind, ns, name), obj, query=query, content_type="application/apply-patch+yaml"
            )
        except KubeError as e:
            if e.status != 404:
                raise
        return self.request("POST", path(kind, ns), obj, query={"fieldManager": FIELD_MANAGER})
