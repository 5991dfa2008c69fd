"""The operator's Kubernetes client: plain-dict objects over the official client's ``DynamicClient``.

Handlers work with plain dicts (what the builders make), not the generated typed models. The
DynamicClient finds each kind's URL (plural, scope, subresources) through the API server's discovery;
only the group/version of the kinds callers name by kind alone is listed here, because a kind name by
itself is ambiguous (cert-manager and Knative both serve a ``Certificate``). kopf runs sync handlers
in a thread pool, so a blocking client is right.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

from kubernetes import client, config
from kubernetes.dynamic import DynamicClient, LazyDiscoverer
from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError
from kubernetes.dynamic.resource import Resource

from radixserve.operator.crds import GROUP, VERSION
from radixserve.operator.objects import Obj
from radixserve.operator.tls import CERT_MANAGER_API

FIELD_MANAGER = "radixserve-operator"
REQUEST_TIMEOUT = (5.0, 30.0)  # connect, read (s): a hung API call must not hold a kopf worker forever

# kind -> apiVersion for the kinds get/list/delete/merge_patch are asked about by name; create and
# apply take the object's own apiVersion, so they work for any kind the cluster serves.
API_VERSIONS: dict[str, str] = {
    "ConfigMap": "v1",
    "Service": "v1",
    "Secret": "v1",
    "Pod": "v1",
    "Node": "v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "PodDisruptionBudget": "policy/v1",
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "InferenceService": f"{GROUP}/{VERSION}",
    "GPUNodePool": f"{GROUP}/{VERSION}",
    "Certificate": CERT_MANAGER_API,  # spec.tls.certManager only
    "CustomResourceDefinition": "apiextensions.k8s.io/v1",  # crd_sync: our two, by name
}

# By default the library caches discovery in a file in the temp dir: that needs a writable one (a
# read-only root filesystem may have none), is shared by every process that talks to the same API
# URL, and can outlive a CRD upgrade. Ours stays in this process's memory; a path under /dev/null
# can never exist, so no file is ever read.
_NO_CACHE_FILE = "/dev/null/radixserve-discovery"


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


# kubernetes' dynamic client has no type information: these subclasses are of Any to mypy.
class _MemoryDiscoverer(LazyDiscoverer):  # type: ignore[misc]
    """Discovers each group/version on first use and keeps it in memory only."""

    def _write_cache(self) -> None:
        pass


class _BoundedClient(DynamicClient):  # type: ignore[misc]
    """Every request, discovery's included, gives up after REQUEST_TIMEOUT."""

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        params.setdefault("_request_timeout", REQUEST_TIMEOUT)
        return super().request(method, path, body, **params)


def _as_dict(_client: object, data: Obj) -> Obj:
    """Keeps the JSON body as a plain dict (the default wraps it in a ResourceInstance)."""
    return data


@contextlib.contextmanager
def _api_errors() -> Iterator[None]:
    """API errors as KubeError, with the message the server's Status gives (else its raw body)."""
    try:
        yield
    except DynamicApiError as e:  # what the DynamicClient raises for every non-2xx answer
        # Its summary() reads the Status only when Content-Type is exactly application/json.
        body = e.body if isinstance(e.body, str) else ""
        try:
            message = str(json.loads(body)["message"])
        except (ValueError, KeyError, TypeError):
            message = body[:500] or str(e.reason)
        raise KubeError(e.status, message) from e


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
        self._lock = threading.Lock()
        self._dynamic: Any = None  # made on first use: discovery needs the API server
        self._resources: dict[tuple[str, str], Resource] = {}  # (apiVersion, kind) -> URL, scope

    def _resource(self, api_version: str, kind: str) -> Resource:
        """The discovered resource; KubeError 404 when the cluster serves no such kind."""
        key = (api_version, kind)
        # kopf calls from several threads and the discoverer's cache is not thread-safe; a lookup
        # after the first is a dict read.
        with self._lock, _api_errors():
            if key not in self._resources:
                if self._dynamic is None:
                    self._dynamic = _BoundedClient(
                        self.api, cache_file=_NO_CACHE_FILE, discoverer=_MemoryDiscoverer
                    )
                group, _, version = api_version.rpartition("/")
                try:
                    self._resources[key] = self._dynamic.resources.get(
                        prefix="apis" if group else "api", group=group, api_version=version, kind=kind
                    )
                except ResourceNotFoundError as e:
                    raise KubeError(404, f"the cluster serves no {kind} in {api_version}") from e
            return self._resources[key]

    def _named(self, kind: str) -> Resource:
        if kind not in API_VERSIONS:
            raise ValueError(f"kind {kind!r} has no apiVersion in radixserve.operator.kube.API_VERSIONS")
        return self._resource(API_VERSIONS[kind], kind)

    def _send(self, verb: str, resource: Resource, **kwargs: Any) -> Obj:
        with _api_errors():
            body = getattr(self._dynamic, verb)(resource, serializer=_as_dict, **kwargs)
        return body if isinstance(body, dict) else {}  # an empty or non-JSON body

    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return self._send("get", self._named(kind), name=name, namespace=namespace)
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
        found = self._send(
            "get", self._named(kind), namespace=namespace, label_selector=label_selector or None
        )
        items: list[Obj] = list(found.get("items") or [])
        if not labels:
            return items
        return [
            o
            for o in items
            if all((o.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    def _post(self, obj: Obj) -> Obj:
        resource = self._resource(obj["apiVersion"], obj["kind"])
        return self._send("create", resource, body=obj, field_manager=FIELD_MANAGER)

    def create(self, obj: Obj) -> Obj | None:
        """Create ``obj``; None when an object of that name exists already (left as it is)."""
        try:
            return self._post(obj)
        except KubeError as e:
            if e.status == 409:
                return None
            raise

    def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        """Delete an object; False when there was none."""
        try:
            self._send("delete", self._named(kind), name=name, namespace=namespace)
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    def merge_patch(
        self, kind: str, namespace: str | None, name: str, patch: Obj, sub: str | None = None
    ) -> Obj:
        """JSON merge patch of the object, or of its subresource ``sub`` (e.g. "status")."""
        target = self._named(kind)
        if sub is not None:
            if sub not in target.subresources:
                raise KubeError(404, f"{kind} has no subresource {sub!r}")
            target = target.subresources[sub]
        content_type = "application/merge-patch+json"
        return self._send(
            "patch", target, body=patch, name=name, namespace=namespace, content_type=content_type
        )

    def apply(self, obj: Obj) -> Obj:
        """Server-side apply: we own exactly the fields we set, so a removed env var goes away too.

        Falls back to create where apply cannot create (API emulators without apply support).
        """
        resource = self._resource(obj["apiVersion"], obj["kind"])
        try:
            return self._send(
                "server_side_apply", resource, body=obj, field_manager=FIELD_MANAGER, force_conflicts=True
            )
        except KubeError as e:
            if e.status != 404:
                raise
        return self._post(obj)
