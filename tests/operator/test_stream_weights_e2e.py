"""spec.model.loadFormat stream through the real operator (kopf against kmock's API emulator): the
fetch-model init containers fetch without the weights, the schedulers stream them (the engine
ConfigMap's RADIXSERVE_LOAD_FORMAT, the credentials Secret in their environment), and a stream from
a source that has no store is refused by name in the status."""

from __future__ import annotations

import hashlib
from functools import partial

import pytest

for _module in ("kopf", "kmock", "pytest_asyncio", "kubernetes"):
    pytest.importorskip(_module, reason=f"the operator e2e tests need {_module} (see docs/development.md)")

from tests.operator import emulator  # noqa: E402
from tests.operator.emulator import Harness  # noqa: E402
from tests.operator.objects import CPU, DEPLOY, ISVC, STS, cond, degraded_of, isvc  # noqa: E402

harness = emulator.harness

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
STREAM = {"uri": "s3://weights/llama-8b", "loadFormat": "stream", "credentialsSecretRef": {"name": "s3"}}


async def test_stream_fetches_without_the_weights_and_the_schedulers_read_the_store(harness: Harness) -> None:
    await harness.call(harness.kube.apply, isvc("llm", model=STREAM, scheduler=CPU))
    # the gateway's Deployment last: the operator applies it after the StatefulSet
    await harness.until(lambda: harness.obj(DEPLOY, "default", "llm-gateway"), what="the gateway")
    sts = harness.obj(STS, "default", "llm-scheduler")
    pod = sts["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][3:] == [
        "s3://weights/llama-8b", "--cache", "/model-cache", "--size-limit", "100Gi", "--skip-weights"
    ]  # fmt: skip
    # Its own cache entry: a full fetch of the same URI never finds the weightless folder complete.
    entry = hashlib.sha256(b"s3://weights/llama-8b without weights").hexdigest()[:16]
    scheduler = pod["containers"][0]
    assert {
        "name": "model",
        "mountPath": "/models/llama-8b",
        "subPath": f"{entry}/llama-8b",
        "readOnly": True,
    } in (scheduler["volumeMounts"])
    assert {"secretRef": {"name": "s3"}} in scheduler["envFrom"]  # the scheduler reads the bucket
    engine = harness.obj("v1/configmaps", "default", "llm-engine")
    assert engine["data"]["RADIXSERVE_LOAD_FORMAT"] == "stream"
    # The gateway only needs the tokenizer: no weights fetched, no credentials beyond its init container.
    gateway = harness.obj(DEPLOY, "default", "llm-gateway")["spec"]["template"]["spec"]
    assert "--skip-weights" in gateway["initContainers"][0]["command"]
    assert all("secretRef" not in ref for ref in gateway["containers"][0]["envFrom"])


async def test_stream_from_a_source_without_a_store_is_refused_by_name(harness: Harness) -> None:
    hub = {"uri": "hf://Qwen/Qwen3-0.6B", "loadFormat": "stream"}
    await harness.call(harness.kube.apply, isvc("hub", model=hub, scheduler=CPU))
    degraded = await harness.until(partial(degraded_of, harness, "hub"), what="hub")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidModel")
    assert "spec.model.loadFormat stream streams from s3:// or gs:// only" in degraded["message"]
    assert "hf://Qwen/Qwen3-0.6B@main" in degraded["message"]
    assert cond(harness.obj(ISVC, "default", "hub"), "Ready")["status"] == "False"
    assert harness.obj(STS, "default", "hub-scheduler") is None
