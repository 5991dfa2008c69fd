"""spec.model.uri and the model cache in the built pods (pure: a spec in, the objects out), and the
messages an unusable model spec gets. The fetcher the init container runs is tested against a real
S3 server in tests/integration/test_model_source.py."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from radixserve.operator.crds import INFERENCE_SERVICE_SPEC
from radixserve.operator.manifests import BuildContext, build_all, config_map, scheduler_statefulset
from radixserve.operator.schema import apply_defaults
from radixserve.operator.validation import Problem, validate
from radixserve.operator.volumes import model_path

CPU = {"device": "cpu", "gpusPerReplica": 0}
FETCH = ["python", "-m", "radixserve.common.model_fetch"]


def ctx(model: dict[str, Any]) -> BuildContext:
    spec = apply_defaults(INFERENCE_SERVICE_SPEC, {"model": model, "scheduler": CPU})
    return BuildContext(name="llm", namespace="prod", spec=spec, image="img:1", scheduler_replicas=1)


def pod(model: dict[str, Any]) -> dict[str, Any]:
    return scheduler_statefulset(ctx(model))["spec"]["template"]["spec"]


def entry(canonical_uri: str) -> str:
    """The cache entry's folder: fixed by the canonical URI, so caches outlive operator upgrades."""
    return hashlib.sha256(canonical_uri.encode()).hexdigest()[:16]


def volume(p: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in p["volumes"] if v["name"] == name)


def test_s3_model_downloads_into_a_shared_cache_pvc_with_credentials_from_a_secret() -> None:
    model = {
        "uri": "s3://weights/team/llama-8b/",
        "credentialsSecretRef": {"name": "s3-creds"},
        "cache": {"pvc": {"claimName": "model-cache"}, "sizeLimit": "500Gi"},
        "sha256": "ab" * 32,
    }
    p = pod(model)
    (init,) = p["initContainers"]
    uri = "s3://weights/team/llama-8b"
    assert init["command"] == [
        *FETCH,
        *(uri, "--cache", "/model-cache", "--size-limit", "500Gi", "--sha256", "ab" * 32),
    ]
    assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]  # AWS_* keys become its environment
    assert init["env"] == [{"name": "HOME", "value": "/tmp"}]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert init["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model", "mountPath": "/model-cache"},  # the whole cache, writable, here only
    ]
    assert volume(p, "model") == {"name": "model", "persistentVolumeClaim": {"claimName": "model-cache"}}
    # The serving container sees its one model, read-only, under the model's own name.
    mounts = p["containers"][0]["volumeMounts"]
    assert {
        "name": "model",
        "mountPath": "/models/llama-8b",
        "subPath": f"{entry(uri)}/llama-8b",
        "readOnly": True,
    } in mounts
    assert config_map(ctx(model))["data"]["RADIXSERVE_MODEL"] == "/models/llama-8b"
    # The credentials stay in the init container.
    assert all("secretRef" not in ref for ref in p["containers"][0].get("envFrom", []))


@pytest.mark.parametrize(("cache", "limit"), [(None, "100Gi"), ({"sizeLimit": "40Gi"}, "40Gi")])
def test_without_a_cache_volume_each_pod_downloads_into_a_bounded_emptydir(
    cache: dict[str, Any] | None, limit: str
) -> None:
    model: dict[str, Any] = {"uri": "hf://Qwen/Qwen3-0.6B@c1899de289a04d12100db370d81485cdf75e47ca"}
    if cache is not None:
        model["cache"] = cache
    p = pod(model)
    assert volume(p, "model") == {"name": "model", "emptyDir": {"sizeLimit": limit}}
    assert p["initContainers"][0]["command"][-2:] == ["--size-limit", limit]
    assert model_path(ctx(model).spec) == "/models/Qwen3-0.6B"


def test_a_node_cache_is_a_hostpath() -> None:
    p = pod({"uri": "hf://org/m", "cache": {"hostPath": "/var/cache/radixserve"}})
    assert volume(p, "model") == {
        "name": "model",
        "hostPath": {"path": "/var/cache/radixserve", "type": "Directory"},
    }
    assert p["initContainers"][0]["command"][3] == "hf://org/m@main"


def test_gs_credentials_are_a_mounted_key_file() -> None:
    p = pod({"uri": "gs://weights/llama", "credentialsSecretRef": {"name": "gcp"}})
    (init,) = p["initContainers"]
    assert volume(p, "model-credentials") == {
        "name": "model-credentials",
        "secret": {"secretName": "gcp", "defaultMode": 0o440},
    }
    assert {
        "name": "model-credentials",
        "mountPath": "/etc/radixserve/model-credentials",
        "readOnly": True,
    } in (init["volumeMounts"])
    assert {
        "name": "GOOGLE_APPLICATION_CREDENTIALS",
        "value": "/etc/radixserve/model-credentials/service-account.json",
    } in init["env"]
    # The serving containers never see the credentials.
    assert all(m["name"] != "model-credentials" for m in p["containers"][0]["volumeMounts"])


@pytest.mark.parametrize(
    ("uri", "mount", "path"),
    [
        (
            "pvc://weights/team/llama-8b",
            {"name": "model", "mountPath": "/models/llama-8b", "readOnly": True, "subPath": "team/llama-8b"},
            "/models/llama-8b",
        ),
        (
            "pvc://llama-8b",
            {"name": "model", "mountPath": "/models/llama-8b", "readOnly": True},
            "/models/llama-8b",
        ),
    ],
)
def test_pvc_uris_mount_the_claim_read_only_with_no_download(
    uri: str, mount: dict[str, Any], path: str
) -> None:
    p = pod({"uri": uri})
    assert "initContainers" not in p
    claim = uri.removeprefix("pvc://").split("/")[0]
    assert volume(p, "model") == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
    }
    assert mount in p["containers"][0]["volumeMounts"]
    assert config_map(ctx({"uri": uri}))["data"]["RADIXSERVE_MODEL"] == path


def test_a_local_path_is_used_as_it_is() -> None:
    p = pod({"uri": "/opt/models/llama"})
    assert "initContainers" not in p and all(v["name"] != "model" for v in p["volumes"])
    assert (
        config_map(ctx({"uri": "file:///opt/models/llama"}))["data"]["RADIXSERVE_MODEL"]
        == "/opt/models/llama"
    )


def test_source_hub_goes_through_the_same_fetcher_and_keeps_its_path() -> None:
    model = {"source": {"hub": {"id": "org/m", "revision": "v1", "tokenSecretRef": {"name": "hf"}}}}
    p = pod(model)
    (init,) = p["initContainers"]
    assert init["command"] == [*FETCH, "hf://org/m@v1", "--cache", "/model-cache", "--size-limit", "100Gi"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in init["env"]
    assert volume(p, "model") == {"name": "model", "emptyDir": {"sizeLimit": "100Gi"}}
    # /models/model as before: the default served model name ("model") does not change.
    assert {
        "name": "model",
        "mountPath": "/models/model",
        "subPath": f"{entry('hf://org/m@v1')}/m",
        "readOnly": True,
    } in p["containers"][0]["volumeMounts"]
    assert config_map(ctx(model))["data"]["RADIXSERVE_MODEL"] == "/models/model"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"uri": "hf://llama"}, "spec.model.uri: hf://llama: a Hub model is hf://org/name[@revision]"),
        ({"uri": "s3://"}, "spec.model.uri: s3://: the bucket is missing (s3://bucket/prefix)"),
        (
            {"uri": "ftp://x/y"},
            "spec.model.uri: ftp://x/y: unknown scheme 'ftp' (hf, s3, gs, pvc or a local path)",
        ),
        (
            {"uri": "s3://bkt/p", "path": "/models/x"},
            "spec.model.uri cannot be combined with spec.model.path or spec.model.source: give one",
        ),
        (
            {"uri": "s3://bkt/p", "source": {"hub": {"id": "org/m"}}},
            "spec.model.uri cannot be combined with spec.model.path or spec.model.source: give one",
        ),
        ({}, "spec.model needs a uri, or exactly one of path or source"),
        (
            {"uri": "pvc://weights/llama", "sha256": "ab" * 32},
            "spec.model.sha256 applies only to a downloaded model (hf://, s3://, gs:// or source.hub)",
        ),
        (
            {"path": "demo", "cache": {"sizeLimit": "1Gi"}},
            "spec.model.cache applies only to a downloaded model (hf://, s3://, gs:// or source.hub)",
        ),
        (
            {"uri": "s3://bkt/p", "sha256": "AB12"},
            "spec.model.sha256: 'AB12' is not a SHA-256 digest (64 hexadecimal characters)",
        ),
        (
            {"uri": "s3://bkt/p", "cache": {"sizeLimit": "10 GB"}},
            "spec.model.cache.sizeLimit: '10 GB' is not a Kubernetes quantity (e.g. 100Gi, 500G)",
        ),
        (
            {"uri": "s3://bkt/p", "cache": {"pvc": {"claimName": "c"}, "hostPath": "/var/cache/m"}},
            "spec.model.cache needs at most one of pvc or hostPath",
        ),
        (
            {"source": {"hub": {"id": "org/m", "revision": "a b"}}},
            "spec.model.source.hub: hf://org/m@a b: 'a b' is not a revision (a commit sha, branch or tag)",
        ),
        (
            {"uri": "hf://org/m", "loadFormat": "stream"},
            "spec.model.loadFormat stream streams from s3:// or gs:// only; spec.model.uri is hf://org/m@main"
            " (use loadFormat auto)",
        ),
        (
            {"uri": "/opt/m", "loadFormat": "stream"},
            "spec.model.loadFormat stream streams from s3:// or gs:// only; spec.model.uri is /opt/m"
            " (use loadFormat auto)",
        ),
        (
            {"path": "demo", "loadFormat": "stream"},
            "spec.model.loadFormat stream streams from s3:// or gs:// only; the model has no uri"
            " (use loadFormat auto)",
        ),
        (
            {"uri": "gs://bkt/p", "loadFormat": "stream", "sha256": "ab" * 32},
            "spec.model.sha256 cannot pin a streamed model (loadFormat stream never writes the weights)",
        ),
    ],
)
def test_unusable_model_specs_are_refused_naming_the_field(model: dict[str, Any], message: str) -> None:
    spec = apply_defaults(INFERENCE_SERVICE_SPEC, {"model": model})
    assert Problem("InvalidModel", message) in validate(spec, None, "redis://r:6379/0")


def test_usable_model_specs_have_no_model_problems() -> None:
    for model in (
        {"uri": "s3://bkt/p", "sha256": "ab" * 32, "credentialsSecretRef": {"name": "s"}},
        {"uri": "hf://org/m@main", "cache": {"pvc": {"claimName": "c"}, "sizeLimit": "1Ti"}},
        {"uri": "pvc://weights/llama"},
        {"uri": "/opt/m"},
        {"source": {"hub": {"id": "org/m"}}, "cache": {"hostPath": "/var/cache/m"}},
    ):
        spec = apply_defaults(INFERENCE_SERVICE_SPEC, {"model": model})
        assert [p for p in validate(spec, None, "redis://r:6379/0") if p.reason == "InvalidModel"] == []


@pytest.mark.parametrize("version", ["1.28.0", "1.37.0"])
def test_every_model_kind_builds_valid_kubernetes(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for model in (
        {"uri": "s3://bkt/p", "credentialsSecretRef": {"name": "s"}, "cache": {"pvc": {"claimName": "c"}}},
        {"uri": "gs://bkt/p", "credentialsSecretRef": {"name": "s"}, "cache": {"hostPath": "/var/cache/m"}},
        {"uri": "hf://org/m", "cache": {"sizeLimit": "20Gi"}},
        {"uri": "pvc://weights/a/b"},
        {"uri": "/opt/m"},
        {"uri": "gs://bkt/p", "loadFormat": "stream", "credentialsSecretRef": {"name": "s"}},
    ):
        for obj in build_all(ctx(model)):
            kv.validate(obj, version, strict=True)


def test_compiled_kernels_live_on_the_model_cache_where_the_model_is_downloaded() -> None:
    """flashinfer's JIT cache (and Triton's, Inductor's) on the cache volume: a scheduler that starts
    again on it (scale to zero and back) compiles nothing. Without a download, the pod's /cache."""
    model = {"uri": "s3://weights/llama-8b", "cache": {"pvc": {"claimName": "model-cache"}}}
    p = pod(model)
    mounts = p["containers"][0]["volumeMounts"]
    assert {"name": "model", "mountPath": "/compile-cache", "subPath": ".compiled"} in mounts  # writable
    data = config_map(ctx(model))["data"]
    assert data["FLASHINFER_WORKSPACE_BASE"] == "/compile-cache"
    assert data["TRITON_CACHE_DIR"] == "/compile-cache/triton"
    local = config_map(ctx({"path": "demo"}))["data"]
    assert local["FLASHINFER_WORKSPACE_BASE"] == "/cache/compiled"


def test_the_compile_cache_folder_is_never_an_entry_the_size_limit_evicts(tmp_path) -> None:
    from radixserve.common.model_cache import COMPILED, ModelCache

    (tmp_path / COMPILED).mkdir()
    (tmp_path / COMPILED / "kernel.so").write_bytes(b"x" * 100)
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / "w.bin").write_bytes(b"x" * 10)
    assert ModelCache(tmp_path, 1).usage() == 10  # the model's bytes only


def test_the_crd_refuses_stream_without_a_store_in_cel_rules_the_api_server_reads() -> None:
    rules = INFERENCE_SERVICE_SPEC["properties"]["model"]["x-kubernetes-validations"]
    assert all(set(r) == {"rule", "message"} and r["message"] for r in rules)
    (store,) = [r for r in rules if "startsWith('s3://')" in r["rule"]]
    assert "startsWith('gs://')" in store["rule"] and "loadFormat stream" in store["message"]
    assert any("has(self.sha256)" in r["rule"] for r in rules)
    assert INFERENCE_SERVICE_SPEC["properties"]["model"]["properties"]["loadFormat"]["enum"] == [
        "auto",
        "stream",
    ]


def test_streamed_gs_weights_give_the_scheduler_the_key_file_too() -> None:
    p = pod({"uri": "gs://weights/llama", "loadFormat": "stream", "credentialsSecretRef": {"name": "gcp"}})
    scheduler = p["containers"][0]
    key = "/etc/radixserve/model-credentials/service-account.json"
    assert {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": key} in scheduler["env"]
    assert {
        "name": "model-credentials",
        "mountPath": "/etc/radixserve/model-credentials",
        "readOnly": True,
    } in (scheduler["volumeMounts"])
    assert {"secretRef": {"name": "gcp"}} in scheduler["envFrom"]
