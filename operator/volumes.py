"""Volumes of the service pods: scratch space, the model (and the init container that fetches it from
the Hub), the gateway's API keys."""

from __future__ import annotations

from radixserve.operator.pods import CONTAINER_SECURITY, Obj
from radixserve.operator.schema import SECRET_KEY, Schema, obj, string

MODEL_DIR = "/models"
CACHE_DIR = "/cache"
AUTH_DIR = "/etc/radixserve/auth"
API_KEYS_FILE = f"{AUTH_DIR}/api-keys"
API_KEYS_DEFAULT_KEY = "api-keys"  # the Secret key spec.auth.apiKeySecretRef.key defaults to
SECRET_FILE_MODE = 0o440  # owner and group (the pods' fsGroup) read; nobody writes


MODEL_SCHEMA: Schema = obj(
    {
        "path": string(description='folder inside the pod, or "demo" for the built-in tiny model'),
        "servedModelName": string(),
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
    description="Exactly one of path or source (pvc or hub).",
)


def model_path(spec: Obj) -> str:
    model = spec["model"]
    source = model.get("source") or {}
    if source.get("pvc"):
        sub = source["pvc"].get("subPath", "").strip("/")
        return f"{MODEL_DIR}/{sub}" if sub else MODEL_DIR
    if source.get("hub"):
        return f"{MODEL_DIR}/model"
    return str(model["path"])


def model_problems(spec: Obj) -> list[str]:
    """What is wrong with the defaulted ``spec``'s model (the schema cannot say "exactly one of")."""
    model = spec.get("model", {})
    source = model.get("source") or {}
    if bool(model.get("path")) == bool(source):
        return ["spec.model needs exactly one of path or source"]
    if source and len([k for k in ("pvc", "hub") if source.get(k)]) != 1:
        return ["spec.model.source needs exactly one of pvc or hub"]
    return []


def model_volumes(spec: Obj, image: str) -> tuple[list[Obj], list[Obj], list[Obj]]:
    """(volumes, mounts, init containers) that put the model where RADIXSERVE_MODEL points.

    ``spec``: the defaulted InferenceService spec; ``image``: the image the init container runs."""
    volumes: list[Obj] = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts: list[Obj] = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    inits: list[Obj] = []
    source = spec["model"].get("source") or {}
    if source.get("pvc"):
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": source["pvc"]["claimName"], "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    elif source.get("hub"):
        hub = source["hub"]
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR})
        env: list[Obj] = [
            {"name": "HF_REPO_ID", "value": hub["id"]},
            {"name": "HF_REVISION", "value": hub.get("revision") or "main"},
            {"name": "HOME", "value": CACHE_DIR},
        ]
        if hub.get("tokenSecretRef"):
            ref = hub["tokenSecretRef"]
            env.append(
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref.get("key") or "token"}},
                }
            )
        # huggingface_hub ships with transformers, so the service image can fetch its own model
        # (over HTTPS: with NetworkPolicies on, the pods may reach port 443 anywhere; see netpol.py).
        script = (
            "import os; from huggingface_hub import snapshot_download; "
            "snapshot_download(os.environ['HF_REPO_ID'], revision=os.environ['HF_REVISION'], "
            f"local_dir='{MODEL_DIR}/model')"
        )
        inits.append(
            {
                "name": "fetch-model",
                "image": image,
                "imagePullPolicy": spec["imagePullPolicy"],
                "command": ["python", "-c", script],
                "env": env,
                "volumeMounts": mounts,
                "securityContext": CONTAINER_SECURITY,
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
            }
        )
    return volumes, mounts, inits


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
