"""The real operator (kopf, our handlers) against kmock's KubernetesEmulator: the ``harness`` fixture.

Imported by the e2e tests after they checked kopf, kmock and pytest-asyncio are installed (a
conftest would fail the whole run without them instead of skipping).

The emulator is an in-memory Kubernetes API (discovery, list, watch, get, create, patch,
delete), not a cluster: no controllers run, so no pods start, Deployments never report ready
replicas unless a test writes them, owner references are stored but nothing garbage-collects,
label selectors are not applied by the server, and patches are plain JSON merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

# Read by radixserve.operator.handlers at import (timer intervals register with the handlers).
os.environ.setdefault("RADIXSERVE_OPERATOR_RESYNC_INTERVAL", "0.5")
os.environ.setdefault("RADIXSERVE_OPERATOR_POOL_INTERVAL", "0.5")
os.environ.setdefault("RADIXSERVE_OPERATOR_REDIS_URL", "redis://redis.test:6379/0")
os.environ.setdefault("RADIXSERVE_OPERATOR_IMAGE", "radixserve:test")

import attrs
import jsonpatch
import kmock
import kmock._internal.k8s as kmock_k8s
import kopf
import kubernetes

from radixserve.operator.kube import Kube
from radixserve.operator.scaling import StaticLoadSource

_counter = itertools.count(1)


class Emulator(kmock.KubernetesEmulator):
    """Fills the metadata a real API server would: uid, resourceVersion, generation, timestamps, and a
    name from ``generateName`` (kopf names its Events that way).

    kopf needs uids for owner references and resourceVersions to order its own patches.
    """

    async def _handle(self, request: Any) -> Any:
        data = request.data if isinstance(request.data, dict) else None
        if data is not None and request.resource is not None:
            meta = data.setdefault("metadata", {})
            rv = str(next(_counter))
            if request.action == kmock.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = f"{meta['generateName']}{rv}"
                meta.setdefault("uid", f"uid-{rv}")
                meta.setdefault(
                    "creationTimestamp", datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                )
                meta["generation"] = 1
                meta["resourceVersion"] = rv
            elif request.action == kmock.action.UPDATE and request.name is not None:
                meta["resourceVersion"] = rv
                if "spec" in data:
                    key = (request.resource, request.namespace, request.name)
                    if key in self.objects:
                        old = self.objects[key].get("metadata", {}).get("generation") or 0
                        meta["generation"] = int(old) + 1
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:
            # A JSON patch whose test (kopf tests resourceVersion) no longer holds: an API server
            # answers 422, and kopf handles it again from a fresh body. The emulator's own answer
            # was a 500, which kopf retries unchanged, stale, until it gives up (the flake that
            # left a deleted object's finalizer on now and then).
            raise PatchTestFailed(message=str(e)) from e


@attrs.frozen
class PatchTestFailed(kmock_k8s.KubernetesError):
    status: int = 422
    reason: str = "Invalid"


def _register(emulator: Emulator) -> None:
    emulator.resources.load_bundled()
    verbs = ["list", "watch", "get", "create", "patch", "update", "delete"]
    emulator.resources["radixserve.io/v1alpha1/inferenceservices"] = kmock.ResourceInfo(
        kind="InferenceService", namespaced=True, verbs=verbs, subresources={"status"}
    )
    emulator.resources["radixserve.io/v1alpha1/gpunodepools"] = kmock.ResourceInfo(
        kind="GPUNodePool", namespaced=False, verbs=verbs, subresources={"status"}
    )


def _kubeconfig(path: Path, url: str) -> None:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emu\n"
        f"clusters: [{{name: emu, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: emu, user: {token: test}}]\n"
        "contexts: [{name: emu, context: {cluster: emu, user: emu, namespace: default}}]\n"
    )


class Harness:
    """The emulator, a client for the test's own requests (run in a thread: the emulator
    shares the test's event loop), the fake load source, and a poller."""

    def __init__(
        self,
        emulator: Emulator,
        kube: Kube,
        loads: StaticLoadSource,
        urls: list[str],
        prefixes: list[str] | None = None,
    ) -> None:
        self.emulator = emulator
        self.kube = kube
        self.loads = loads
        self.load_urls = urls  # the Redis URLs the operator read load from
        self.load_prefixes = prefixes if prefixes is not None else []  # ... and the key prefixes

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    def obj(self, kind_path: str, namespace: str | None, name: str) -> Any:
        """The stored object, or None (typed Any: tests index into it directly)."""
        try:  # ObjectsArray parses "group/version/plural" in [] but not in `in`
            obj = self.emulator.objects[kind_path, namespace, name]
        except KeyError:
            return None
        return None if obj.deleted else dict(obj.raw)

    async def until(self, check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                result = check()
            except (KeyError, TypeError, IndexError, AttributeError):
                result = None
            if result:
                return result
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def serving_emulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Emulator, Path]]:
    """A fresh emulator on a free port and a kubeconfig for it (also made this process's default)."""
    emulator = Emulator()
    _register(emulator)
    async with emulator, kmock.Server(emulator, port=0) as server:
        config = tmp_path / "kubeconfig"
        _kubeconfig(config, str(server.url).rstrip("/"))
        monkeypatch.setenv("KUBECONFIG", str(config))
        # The client reads $KUBECONFIG once at import; kopf's login goes through it.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))
        kubernetes.config.load_kube_config(config_file=str(config))
        yield emulator, config


@contextlib.asynccontextmanager
async def running_operator(
    settings: kopf.OperatorSettings, memo: kopf.Memo, **options: Any
) -> AsyncIterator[None]:
    """kopf's operator in a thread of its own, with its own event loop, until the block ends.

    kopf's stop waits up to 5 s for every task created on its loop after it started, then cancels
    them: on the tests' loop those are the emulator's connection handlers (and another replica's
    tasks), so each stop took the full 5 s. On its own loop it stops when its own tasks do."""
    # An object's worker idles this long for its next event before it exits, and the stop waits
    # for the workers (kopf's default is 5 s): a shorter idle only starts a new worker more often.
    settings.queueing.idle_timeout = 0.3
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(
                kopf.operator(settings=settings, memo=memo, stop_flag=stop, ready_flag=ready, **options)
            )
        except BaseException as e:
            failure.append(e)
            ready.set()

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 15), "the operator was not ready in 15 s"
    try:
        if failure:
            raise failure[0]
        yield
    finally:
        stop.set()
        # The emulator keeps serving on this loop while the operator winds down in its thread.
        await asyncio.to_thread(thread.join, 20)
        assert not thread.is_alive(), "the operator did not stop in 20 s"
        # Sync handlers kopf left running ("orphaned") still talk to the emulator: let them
        # finish while it serves, rather than fail against a closed port after the test.
        await asyncio.to_thread(settings.execution.executor.shutdown, True)
    if failure:
        raise failure[0]


@pytest_asyncio.fixture()
async def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    import radixserve.operator.handlers  # noqa: F401  (registers with kopf's default registry)

    async with serving_emulator(tmp_path, monkeypatch) as (emulator, _):
        loads = StaticLoadSource()
        urls: list[str] = []
        prefixes: list[str] = []

        def load_source(url: str, key_prefix: str) -> StaticLoadSource:
            urls.append(url)
            prefixes.append(key_prefix)
            return loads

        memo = kopf.Memo(kube=Kube(), load_source=load_source)
        async with running_operator(kopf.OperatorSettings(), memo, clusterwide=True, standalone=True):
            yield Harness(emulator, Kube(user_agent="radixserve-tests"), loads, urls, prefixes)
        # Every request the operator (kopf and our client) made is one the chart's ClusterRole allows.
        allowed = chart_rbac()
        used = {a for r in emulator._requests if _by_operator(r) and (a := access(r)) is not None}
        assert used <= allowed, f"the chart's ClusterRole misses {sorted(used - allowed)}"


RBAC = Path(__file__).resolve().parents[2] / "helm" / "radixserve" / "templates" / "rbac.yaml"


def chart_rbac() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples the chart grants; template lines are dropped (names only).

    Every ClusterRole counts: the Secret reader's is bound only in the namespaces the operator
    watches (tests/helm checks that), and the emulator's tests play in one namespace."""
    text = "\n".join(line for line in RBAC.read_text().splitlines() if "{{" not in line)
    roles = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "ClusterRole"]
    return {
        (g, r, v)
        for role in roles
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def _by_operator(request: Any) -> bool:
    agent = request.headers.get("User-Agent", "")
    return agent.startswith(("kopf/", "radixserve-operator"))


def access(request: Any) -> tuple[str, str, str] | None:
    """The RBAC triple a request needs; None for discovery."""
    parts = [p for p in request.url.path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) > 2:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    if not rest:
        return None
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
    if method == "GET":
        verb = "get" if len(rest) > 1 else ("watch" if request.url.query.get("watch") else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return group, resource, verb
