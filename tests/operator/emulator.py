"""The real operator (kopf, our handlers) against kmock's KubernetesEmulator.

The emulator is an in-memory Kubernetes API (discovery, list, watch, get, create, patch,
delete), not a cluster: no controllers run, so no pods start, Deployments never report ready
replicas unless a test writes them, owner references are stored but nothing garbage-collects,
label selectors are not applied by the server, and patches are plain JSON merges.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

# Read by radixserve.operator.handlers at import (timer intervals register with the handlers).
os.environ.setdefault("RADIXSERVE_OPERATOR_RESYNC_INTERVAL", "0.5")
os.environ.setdefault("RADIXSERVE_OPERATOR_POOL_INTERVAL", "0.5")
os.environ.setdefault("RADIXSERVE_OPERATOR_REDIS_URL", "redis://redis.test:6379/0")
os.environ.setdefault("RADIXSERVE_OPERATOR_IMAGE", "radixserve:test")

kopf = pytest.importorskip("kopf", reason="the operator tests need kopf (pip install kopf)")
kmock = pytest.importorskip("kmock", reason="the operator tests need kmock (pip install kmock pytest-asyncio)")
kubernetes = pytest.importorskip("kubernetes", reason="the operator tests need the kubernetes client")

from radixserve.operator.kube import Kube  # noqa: E402
from radixserve.operator.scaling import StaticLoadSource  # noqa: E402

_counter = itertools.count(1)


class Emulator(kmock.KubernetesEmulator):
    """Fills the metadata a real API server would: uid, resourceVersion, generation, timestamps.

    kopf needs uids for owner references and resourceVersions to order its own patches.
    """

    async def _handle(self, request: Any) -> Any:
        data = request.data if isinstance(request.data, dict) else None
        if data is not None and request.resource is not None:
            meta = data.setdefault("metadata", {})
            rv = str(next(_counter))
            if request.action == kmock.action.CREATE:
                meta.setdefault("uid", f"uid-{rv}")
                meta.setdefault("creationTimestamp", datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                meta["generation"] = 1
                meta["resourceVersion"] = rv
            elif request.action == kmock.action.UPDATE and request.name is not None:
                meta["resourceVersion"] = rv
                if "spec" in data:
                    key = (request.resource, request.namespace, request.name)
                    if key in self.objects:
                        old = self.objects[key].get("metadata", {}).get("generation") or 0
                        meta["generation"] = int(old) + 1
        return await super()._handle(request)


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

    def __init__(self, emulator: Emulator, kube: Kube, loads: StaticLoadSource) -> None:
        self.emulator = emulator
        self.kube = kube
        self.loads = loads

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    def obj(self, kind_path: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (kind_path, namespace, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return dict(self.emulator.objects[key].raw)

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


@pytest_asyncio.fixture()
async def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    import radixserve.operator.handlers  # noqa: F401  (registers with kopf's default registry)

    emulator = Emulator()
    _register(emulator)
    async with emulator, kmock.Server(emulator, port=0) as server:
        config = tmp_path / "kubeconfig"
        _kubeconfig(config, str(server.url).rstrip("/"))
        monkeypatch.setenv("KUBECONFIG", str(config))
        # The client reads $KUBECONFIG once at import; kopf's login goes through it.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))
        kubernetes.config.load_kube_config(config_file=str(config))
        kube = Kube()
        loads = StaticLoadSource()
        memo = kopf.Memo(kube=kube, load_source=lambda url: loads)
        stop = asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.create_task(
            kopf.operator(clusterwide=True, standalone=True, memo=memo, stop_flag=stop, ready_flag=ready)
        )
        await asyncio.wait_for(ready.wait(), 15)
        try:
            yield Harness(emulator, kube, loads)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
