"""The operator's Kubernetes client (operator/kube.py) against kmock's API emulator: the calls the
handlers make, on core and custom kinds, over real HTTP (discovery included)."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

for _module in ("kmock", "pytest_asyncio", "kubernetes"):
    pytest.importorskip(_module, reason=f"the operator client tests need {_module} (see docs/development.md)")

import kmock  # noqa: E402
import pytest_asyncio  # noqa: E402
from kubernetes import client  # noqa: E402

from radixserve.operator import kube as kube_module  # noqa: E402
from radixserve.operator.kube import Kube, KubeError  # noqa: E402
from tests.operator import emulator  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

AGENT = "radixserve-kube-tests"
CERTIFICATES = "cert-manager.io/v1/certificates"


@pytest_asyncio.fixture()
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Any, Kube]]:
    """A fresh emulator (our CRDs registered, no cert-manager) and a client for it."""
    async with emulator.serving_emulator(tmp_path, monkeypatch) as (emu, _):
        yield emu, Kube(user_agent=AGENT)


async def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)  # the emulator serves on this test's loop


def config_map(name: str, value: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "default"}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": value}}


def pod(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    meta = {"name": name, "namespace": namespace, "labels": labels}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": []}}


def certificate(name: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "default"}
    return {"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": meta, "spec": {}}


async def test_core_kind_round_trip(served: tuple[Any, Kube]) -> None:
    emu, kube = served
    made = await call(kube.create, config_map("cm", "one"))
    assert made["metadata"]["uid"] and made["data"] == {"k": "one"}
    assert await call(kube.create, config_map("cm", "two")) is None  # exists: left as it is
    assert (await call(kube.get, "ConfigMap", "default", "cm"))["data"] == {"k": "one"}

    await call(kube.apply, config_map("cm", "three"))
    assert (await call(kube.get, "ConfigMap", "default", "cm"))["data"] == {"k": "three"}
    patched = await call(kube.merge_patch, "ConfigMap", "default", "cm", {"data": {"k": "four"}})
    assert patched["data"] == {"k": "four"}

    assert await call(kube.delete, "ConfigMap", "default", "cm") is True
    assert await call(kube.delete, "ConfigMap", "default", "cm") is False
    assert await call(kube.get, "ConfigMap", "default", "cm") is None

    # Server-side apply as the operator's field manager, forcing conflicts; creates name it too.
    patches = [r for r in emu._requests if r.url.path.endswith("/configmaps/cm") and r.method == "PATCH"]
    applied = [r for r in patches if r.headers["Content-Type"] == "application/apply-patch+yaml"]
    assert applied and applied[0].url.query["fieldManager"] == "radixserve-operator"
    # The API server reads it with Go's strconv.ParseBool (client 36 sends "True", 37 "true").
    assert applied[0].url.query["force"] in ("1", "t", "T", "true", "TRUE", "True")
    posts = [r for r in emu._requests if r.url.path == "/api/v1/namespaces/default/configmaps"]
    assert posts and all(r.url.query["fieldManager"] == "radixserve-operator" for r in posts)


async def test_list_keeps_only_the_asked_labels_even_where_the_server_ignores_the_selector(
    served: tuple[Any, Kube],
) -> None:
    emu, kube = served
    await call(kube.apply, pod("a", "default", {"app": "a", "tier": "x"}))
    await call(kube.apply, pod("b", "default", {"app": "b"}))
    await call(kube.apply, pod("c", "other", {"app": "a"}))

    names = [p["metadata"]["name"] for p in await call(kube.list, "Pod", "default", labels={"app": "a"})]
    assert names == ["a"]
    everywhere = await call(kube.list, "Pod", None, labels={"app": "a"})
    assert sorted(p["metadata"]["name"] for p in everywhere) == ["a", "c"]
    assert len(await call(kube.list, "Pod", "default")) == 2
    lists = [
        r for r in emu._requests if r.url.path == "/api/v1/namespaces/default/pods" and r.method == "GET"
    ]
    assert lists[0].url.query["labelSelector"] == "app=a"  # sent, though this server ignores it

    await call(kube.list, "Node", None, "radixserve.io/gpu-node-pool=h100")  # a selector as given
    (nodes,) = [r for r in emu._requests if r.url.path == "/api/v1/nodes"]
    assert nodes.url.query["labelSelector"] == "radixserve.io/gpu-node-pool=h100"


async def test_custom_kinds_and_their_status_subresource(served: tuple[Any, Kube]) -> None:
    emu, kube = served
    pool = {"apiVersion": "radixserve.io/v1alpha1", "kind": "GPUNodePool", "metadata": {"name": "h100"}}
    await call(kube.apply, {**pool, "spec": {"nodeSelector": {"gpu": "h100"}}})  # apply 404s here: created
    await call(kube.apply, {**pool, "spec": {"nodeSelector": {"gpu": "h200"}}})
    await call(kube.merge_patch, "GPUNodePool", None, "h100", {"status": {"nodes": 2}}, "status")
    stored = await call(kube.get, "GPUNodePool", None, "h100")
    assert (stored["spec"]["nodeSelector"], stored["status"]) == ({"gpu": "h200"}, {"nodes": 2})
    assert any(r.url.path == "/apis/radixserve.io/v1alpha1/gpunodepools/h100/status" for r in emu._requests)

    meta = {"name": "llm", "namespace": "team"}
    isvc = {"apiVersion": "radixserve.io/v1alpha1", "kind": "InferenceService", "metadata": meta}
    await call(kube.apply, {**isvc, "spec": {"model": {"path": "demo"}}})
    (listed,) = await call(kube.list, "InferenceService")
    assert listed["metadata"]["name"] == "llm"
    assert await call(kube.delete, "InferenceService", "team", "llm") is True
    assert await call(kube.list, "InferenceService", "team") == []

    with pytest.raises(KubeError) as missing:  # no such subresource: what an API server says too
        await call(kube.merge_patch, "GPUNodePool", None, "h100", {}, "scale")
    assert missing.value.status == 404


async def test_a_kind_the_cluster_does_not_serve_is_a_404(served: tuple[Any, Kube]) -> None:
    emu, kube = served
    for attempt in (kube.apply, kube.create):  # handlers report CertManagerMissing on this
        with pytest.raises(KubeError) as e:
            await call(attempt, certificate("tls"))
        assert e.value.status == 404 and "Certificate" in str(e.value)
    assert await call(kube.get, "Certificate", "default", "tls") is None
    assert await call(kube.delete, "Certificate", "default", "tls") is False
    with pytest.raises(KubeError, match="HTTP 404"):
        await call(kube.list, "Certificate", "default")
    assert not any("cert-manager.io/v1/" in r.url.path for r in emu._requests)  # never guessed at

    # cert-manager installed while the operator runs: the next call discovers it.
    verbs = ["list", "get", "create", "patch", "delete"]
    emu.resources[CERTIFICATES] = kmock.ResourceInfo(kind="Certificate", namespaced=True, verbs=verbs)
    await call(kube.apply, certificate("tls"))
    assert (await call(kube.get, "Certificate", "default", "tls"))["metadata"]["name"] == "tls"


async def test_errors_carry_the_status_and_the_servers_message(served: tuple[Any, Kube]) -> None:
    _, kube = served
    with pytest.raises(KubeError) as e:
        await call(kube.merge_patch, "ConfigMap", "default", "absent", {"data": {}})
    assert e.value.status == 404
    assert str(e.value).startswith("HTTP 404: The object is not found")  # the Status's message, not JSON
    with pytest.raises(ValueError, match="'Widget'"):
        await call(kube.get, "Widget", "default", "w")


async def test_every_request_carries_the_user_agent_and_discovery_stays_in_memory(
    served: tuple[Any, Kube], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    emu, _ = served
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the library's default cache file goes
    kube = Kube(user_agent=AGENT)
    await call(kube.apply, config_map("cm", "one"))
    await call(kube.list, "InferenceService")
    assert emu._requests and {r.headers["User-Agent"] for r in emu._requests} == {AGENT}
    paths = [r.url.path for r in emu._requests]
    assert "/apis" in paths and "/api/v1" in paths  # kinds found by discovery, each group read once
    assert paths.count("/api/v1") == 1
    assert list(temp.iterdir()) == []  # a read-only root filesystem is fine


async def test_a_hung_api_server_does_not_hold_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_module, "REQUEST_TIMEOUT", (1.0, 0.3))
    with socket.socket() as hung:  # accepts connections (the kernel's backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        configuration = client.Configuration(host=f"http://127.0.0.1:{hung.getsockname()[1]}")
        configuration.retries = 0
        kube = Kube(client.ApiClient(configuration))
        start = time.monotonic()
        with pytest.raises(Exception, match=r"[Tt]imed? ?out"):
            await call(kube.get, "Pod", "default", "p")  # discovery is the first request: bounded too
        assert time.monotonic() - start < 5
