"""Volumes of the service pods: scratch space, the model (and the init container that fetches it into
the model cache), the gateway's API keys.

The model (``spec.model``) is one of:

* ``uri``: ``hf://org/name[@revision]``, ``s3://bucket/prefix``, ``gs://bucket/prefix`` (downloaded),
  ``pvc://claim/path`` (mounted read-only) or an absolute path in the pod (used as it is);
* ``path`` (a folder in the pod, or "demo"), or ``source.pvc`` / ``source.hub`` (the older spelling).

A downloaded model goes through the model cache (radixserve.common.model_cache): the volume ``model``
(a shared PVC or a node's hostPath from ``spec.model.cache``, else a pod-private emptyDir bounded by the
cache's size limit) is mounted whole at /model-cache in the ``fetch-model`` init container, which
downloads into ``<entry>/<name>`` unless a complete copy is there; the serving containers mount only
that folder, read-only, at /models/<name> (a subPath), so a shared cache's other models stay out of
their sight and the folder's name, their default served model name, is the model's.
"""

from __future__ import annotations

import dataclasses

from radixserve.common.model_cache import COMPILED
from radixserve.common.model_source import (
    DEFAULT_CACHE_SIZE,
    ModelSource,
    ModelSourceError,
    check_sha256,
    parse_model_uri,
    parse_quantity,
)
from radixserve.common.service_config import LOAD_FORMATS, QUANTIZATIONS
from radixserve.operator.objects import Obj
from radixserve.operator.pods import CONTAINER_SECURITY
from radixserve.operator.schema import SECRET_KEY, Schema, obj, string

MODEL_DIR = "/models"
MODEL_CACHE_DIR = "/model-cache"  # the whole cache, in the init container only
MODEL_CREDENTIALS_DIR = "/etc/radixserve/model-credentials"
GCS_KEY_FILE = "service-account.json"  # the credentials Secret's key a gs:// download reads
HUB_FOLDER = "model"  # where source.hub's model appears: its default served name stays "model"
CACHE_DIR = "/cache"
# Compiled kernels: on the model cache (its .compiled folder, which the fetch-model init container
# makes) where the model is downloaded, so they outlive the pod; else in the pod's /cache.
COMPILE_CACHE_DIR = "/compile-cache"
AUTH_DIR = "/etc/radixserve/auth"
API_KEYS_FILE = f"{AUTH_DIR}/api-keys"
API_KEYS_DEFAULT_KEY = "api-keys"  # the Secret key spec.auth.apiKeySecretRef.key defaults to
SECRET_FILE_MODE = 0o440  # owner and group (the pods' fsGroup) read; nobody writes


# loadFormat stream reads the weights from an object store at load: only s3:// and gs:// have one.
STREAM_RULE = {
    "rule": "!has(self.loadFormat) || self.loadFormat != 'stream'"
    " || (has(self.uri) && (self.uri.startsWith('s3://') || self.uri.startsWith('gs://')))",
    "message": "loadFormat stream streams the weights from s3:// or gs:// only: set uri to one, or use "
    "loadFormat auto (hf://, pvc://, local paths and source load through the cache or in place)",
}
STREAM_PIN_RULE = {
    "rule": "!has(self.loadFormat) || self.loadFormat != 'stream' || !has(self.sha256)",
    "message": "sha256 pins the whole downloaded folder; with loadFormat stream the weights are never "
    "written to digest: drop one of them",
}

MODEL_SCHEMA: Schema = obj(
    {
        "uri": string(
            description="hf://org/name[@revision] (a commit sha pins it), s3://bucket/prefix, "
            "gs://bucket/prefix, pvc://claim/path, or an absolute path in the pod; instead of path and source"
        ),
        "sha256": string(
            pattern="^[0-9a-f]{64}$",
            description="the digest the downloaded folder must have: radixserve fetch-model --digest DIR",
        ),
        "credentialsSecretRef": obj(
            {"name": string(minLength=1)},
            required=["name"],
            description="Secret whose keys the download sees as environment variables: "
            "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL (s3://), "
            f"HF_TOKEN (hf://); for gs:// its key {GCS_KEY_FILE} is the service-account key",
        ),
        "cache": obj(
            {
                "pvc": obj(
                    {"claimName": string(minLength=1)},
                    required=["claimName"],
                    description="a shared cache: ReadWriteMany when the pods run on several nodes",
                ),
                "hostPath": string(description="a node's cache folder, writable by uid 1000"),
                "sizeLimit": string(
                    description=f"what the cache may hold, e.g. 200Gi (default {DEFAULT_CACHE_SIZE})"
                ),
            },
            description="Where downloads are kept: without pvc or hostPath, in each pod "
            "(an emptyDir of sizeLimit).",
        ),
        "path": string(description='folder inside the pod, or "demo" for the built-in tiny model'),
        "servedModelName": string(),
        "quantization": string(
            enum=list(QUANTIZATIONS),
            description="fp8: the schedulers quantize the linear layers' weights to FP8 at load"
            " (--quantization fp8; for a bf16/fp32 checkpoint). FP8 checkpoints (fp8, compressed-tensors"
            " FP8, fbgemm_fp8) are served in FP8 without it. Default: none",
        ),
        "loadFormat": string(
            enum=list(LOAD_FORMATS),
            description="stream (s3:// and gs:// only): the init container fetches all but the weights "
            "(fetch-model --skip-weights) and the schedulers stream the *.safetensors from the store "
            "into memory at load (--load-format stream; they get the credentials Secret too), so the "
            "weights never touch the cache volume. Default auto: the whole model through the cache",
        ),
        "source": obj(
            {
                "pvc": obj(
                    {"claimName": string(minLength=1), "subPath": string(default="")},
                    required=["claimName"],
                ),
                "hub": obj(
                    {
                        "id": string(minLength=1, description="Hugging Face repository id"),
                        "revision": string(),
                        "tokenSecretRef": SECRET_KEY,
                    },
                    required=["id"],
                ),
            },
            description="Where the model comes from when it is not baked into the image.",
        ),
    },
    description="uri, or exactly one of path or source (pvc or hub).",
) | {"x-kubernetes-validations": [STREAM_RULE, STREAM_PIN_RULE]}


def _uri(spec: Obj) -> ModelSource | None:
    uri = spec["model"].get("uri")
    return parse_model_uri(uri) if uri else None


def _hub(spec: Obj) -> ModelSource | None:
    """source.hub as the hf:// source it is (the same fetcher downloads both)."""
    hub = (spec["model"].get("source") or {}).get("hub")
    if not hub:
        return None
    return parse_model_uri(f"hf://{hub['id']}@{hub.get('revision') or 'main'}")


def downloaded(spec: Obj) -> tuple[ModelSource, str] | None:
    """(the source, the folder under /models the serving containers see it in) of a model the
    init container downloads; None for one that is used in place."""
    source = _uri(spec)
    if source is not None and streamed(spec) and source.scheme in ("s3", "gs"):
        return dataclasses.replace(source, weights=False), source.name  # its own cache entry
    if source is not None:
        return (source, source.name) if source.downloads else None
    hub = _hub(spec)
    return (hub, HUB_FOLDER) if hub is not None else None


def streamed(spec: Obj) -> bool:
    """Whether the schedulers stream the weights from the store (spec.model.loadFormat stream)."""
    return bool(spec["model"].get("loadFormat") == "stream")


def model_path(spec: Obj) -> str:
    """RADIXSERVE_MODEL: where the serving containers find the model (``spec`` is valid)."""
    model = spec["model"]
    source = _uri(spec)
    if source is not None:
        return source.path if source.scheme == "local" else f"{MODEL_DIR}/{source.name}"
    legacy = model.get("source") or {}
    if legacy.get("pvc"):
        sub = legacy["pvc"].get("subPath", "").strip("/")
        return f"{MODEL_DIR}/{sub}" if sub else MODEL_DIR
    if legacy.get("hub"):
        return f"{MODEL_DIR}/{HUB_FOLDER}"
    return str(model["path"])


def model_problems(spec: Obj) -> list[str]:
    """What is wrong with the defaulted ``spec``'s model (the schema cannot say "exactly one of")."""
    model = spec.get("model", {})
    source = model.get("source") or {}
    if model.get("uri"):
        if model.get("path") or source:
            return ["spec.model.uri cannot be combined with spec.model.path or spec.model.source: give one"]
        try:
            parse_model_uri(model["uri"])
        except ModelSourceError as e:
            return [f"spec.model.uri: {e}"]
    elif bool(model.get("path")) == bool(source):
        return ["spec.model needs a uri, or exactly one of path or source"]
    elif source and len([k for k in ("pvc", "hub") if source.get(k)]) != 1:
        return ["spec.model.source needs exactly one of pvc or hub"]
    elif source.get("hub"):
        try:
            _hub(spec)
        except ModelSourceError as e:
            return [f"spec.model.source.hub: {e}"]
    return _stream_problems(spec) + _download_problems(spec)


def _stream_problems(spec: Obj) -> list[str]:
    """loadFormat stream: an s3:// or gs:// uri, no sha256 (the CRD's STREAM_RULEs, said by name)."""
    model = spec["model"]
    if not streamed(spec):
        return []
    source = _uri(spec)
    if source is None or source.scheme not in ("s3", "gs"):
        what = f"spec.model.uri is {source.uri}" if source is not None else "the model has no uri"
        return [
            f"spec.model.loadFormat stream streams from s3:// or gs:// only; {what} (use loadFormat auto)"
        ]
    if model.get("sha256"):
        return ["spec.model.sha256 cannot pin a streamed model (loadFormat stream never writes the weights)"]
    return []


def _download_problems(spec: Obj) -> list[str]:
    """The download settings: only for a downloaded model, each well formed."""
    model = spec["model"]
    if downloaded(spec) is None:
        given = [f for f in ("sha256", "credentialsSecretRef", "cache") if model.get(f)]
        return [
            f"spec.model.{f} applies only to a downloaded model (hf://, s3://, gs:// or source.hub)"
            for f in given
        ]
    out = []
    if model.get("sha256"):
        try:
            check_sha256(model["sha256"])
        except ModelSourceError as e:
            out.append(f"spec.model.sha256: {e}")
    cache = model.get("cache") or {}
    if cache.get("pvc") and cache.get("hostPath"):
        out.append("spec.model.cache needs at most one of pvc or hostPath")
    if cache.get("hostPath") and not str(cache["hostPath"]).startswith("/"):
        out.append(f"spec.model.cache.hostPath: {cache['hostPath']!r} is not an absolute path")
    if cache.get("sizeLimit"):
        try:
            parse_quantity(cache["sizeLimit"])
        except ValueError as e:
            out.append(f"spec.model.cache.sizeLimit: {e}")
    return out


def model_volumes(spec: Obj, image: str) -> tuple[list[Obj], list[Obj], list[Obj]]:
    """(volumes, mounts, init containers) that put the model where RADIXSERVE_MODEL points.

    ``spec``: the defaulted, valid InferenceService spec; ``image``: the image the init container runs."""
    volumes: list[Obj] = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts: list[Obj] = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    fetched = downloaded(spec)
    if fetched is not None:
        source, folder = fetched
        volumes.append({"name": "model", **_cache_volume(spec)})
        mount: Obj = {
            "name": "model",
            "mountPath": f"{MODEL_DIR}/{folder}",
            "subPath": source.relative_model_dir(),
        }
        init = _fetch_container(spec, image, source, volumes)
        compiled = {"name": "model", "mountPath": COMPILE_CACHE_DIR, "subPath": COMPILED}
        return volumes, [*mounts, {**mount, "readOnly": True}, compiled], [init]
    uri = _uri(spec)
    legacy = spec["model"].get("source") or {}
    if uri is not None and uri.scheme == "pvc":
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": uri.location, "readOnly": True}}
        )
        mount = {"name": "model", "mountPath": f"{MODEL_DIR}/{uri.name}", "readOnly": True}
        mounts.append({**mount, "subPath": uri.path} if uri.path else mount)
    elif legacy.get("pvc"):
        claim = {"claimName": legacy["pvc"]["claimName"], "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    return volumes, mounts, []


def compile_cache_dir(spec: Obj) -> str:
    """Where the schedulers keep compiled kernels (flashinfer's JIT cache, Triton's, Inductor's)."""
    return COMPILE_CACHE_DIR if downloaded(spec) is not None else f"{CACHE_DIR}/compiled"


def _cache_volume(spec: Obj) -> Obj:
    """The model volume's source: spec.model.cache's PVC or hostPath, else an emptyDir as large as
    the cache's size limit (the kubelet evicts a pod whose emptyDir outgrows it)."""
    cache = spec["model"].get("cache") or {}
    if cache.get("pvc"):
        return {"persistentVolumeClaim": {"claimName": cache["pvc"]["claimName"]}}
    if cache.get("hostPath"):
        # Directory, not DirectoryOrCreate: the kubelet would create it as root, which the fetcher
        # (uid 1000; fsGroup does not apply to hostPath) could not write. Pre-create it, owned by 1000.
        return {"hostPath": {"path": cache["hostPath"], "type": "Directory"}}
    return {"emptyDir": {"sizeLimit": cache.get("sizeLimit") or DEFAULT_CACHE_SIZE}}


def _fetch_container(spec: Obj, image: str, source: ModelSource, volumes: list[Obj]) -> Obj:
    """The init container that downloads ``source`` into the cache (appending the credentials'
    volume to ``volumes`` where one is needed)."""
    model = spec["model"]
    command = ["python", "-m", "radixserve.common.model_fetch", source.uri, "--cache", MODEL_CACHE_DIR]
    command += ["--size-limit", (model.get("cache") or {}).get("sizeLimit") or DEFAULT_CACHE_SIZE]
    if not source.weights:  # loadFormat stream: the schedulers read the weights from the store
        command.append("--skip-weights")
    if model.get("sha256"):
        command += ["--sha256", model["sha256"]]
    env: list[Obj] = [{"name": "HOME", "value": "/tmp"}]
    mounts: list[Obj] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model", "mountPath": MODEL_CACHE_DIR},
    ]
    init: Obj = {
        "name": "fetch-model",
        "image": image,
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": command,
        "env": env,
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
        # The fetcher writes one line naming what is missing; a crash leaves its log's last lines.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    secret = (model.get("credentialsSecretRef") or {}).get("name")
    if secret:
        if source.scheme == "gs":  # the key file's volume, which a streaming scheduler mounts too
            volumes.append(
                {
                    "name": "model-credentials",
                    "secret": {"secretName": secret, "defaultMode": SECRET_FILE_MODE},
                }
            )
        _add_store_credentials(init, secret, source.scheme == "gs")
    token = ((model.get("source") or {}).get("hub") or {}).get("tokenSecretRef")
    if token:
        ref = {"name": token["name"], "key": token.get("key") or "token"}
        init["env"].append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    # huggingface_hub ships with transformers, so the service image fetches its own Hub models (over
    # HTTPS: with NetworkPolicies on, the pods may reach port 443 anywhere; see netpol.py); s3:// and
    # gs:// need the image's [s3] / [gcs] extras.
    return init


def add_stream_credentials(spec: Obj, container: Obj) -> None:
    """With loadFormat stream, the scheduler ``container`` reads the store itself: the credentials
    Secret as its environment (and for gs:// the key file the init container mounts)."""
    secret = (spec["model"].get("credentialsSecretRef") or {}).get("name")
    if not streamed(spec) or not secret:
        return
    source = _uri(spec)
    _add_store_credentials(container, secret, source is not None and source.scheme == "gs")


def _add_store_credentials(container: Obj, secret: str, gcs_key: bool) -> None:
    """The credentials Secret as ``container``'s environment; ``gcs_key``: also its service-account
    key file (the pod's ``model-credentials`` volume) and GOOGLE_APPLICATION_CREDENTIALS naming it."""
    container["envFrom"] = [*container.get("envFrom", []), {"secretRef": {"name": secret}}]
    if gcs_key:
        mount = {"name": "model-credentials", "mountPath": MODEL_CREDENTIALS_DIR, "readOnly": True}
        container["volumeMounts"] = [*container.get("volumeMounts", []), mount]
        key = {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": f"{MODEL_CREDENTIALS_DIR}/{GCS_KEY_FILE}"}
        container["env"] = [*container.get("env", []), key]


def add_api_keys(pod: Obj, container: Obj, ref: Obj) -> str:
    """Mount key ``ref.key`` of Secret ``ref.name`` (the API keys, one per line) read-only in
    ``container`` of ``pod`` (a pod spec); returns the file's path. The kubelet refreshes the file
    when the Secret changes."""
    item = {"key": ref.get("key") or API_KEYS_DEFAULT_KEY, "path": API_KEYS_FILE.rsplit("/", 1)[1]}
    secret = {"secretName": ref["name"], "items": [item], "defaultMode": SECRET_FILE_MODE}
    pod["volumes"] = [*pod.get("volumes", []), {"name": "api-keys", "secret": secret}]
    # A new list: the init container shares the old one and needs no keys.
    container["volumeMounts"] = [
        *container.get("volumeMounts", []),
        {"name": "api-keys", "mountPath": AUTH_DIR, "readOnly": True},
    ]
    return API_KEYS_FILE
