"""Pod-level pieces the manifests share: the scheduler's processes per pod, the downward API, probes,
security contexts, /dev/shm."""

from __future__ import annotations

from radixserve.operator.objects import Obj

CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,  # writes go to the /cache and /tmp emptyDirs
}
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
# A scheduler pod with several GPUs runs one process per GPU (tensor parallelism, --tp-size) and NCCL
# passes data between them through /dev/shm; the container runtime's default is 64 MiB, too small
# for NCCL's shared-memory buffers and torch's inter-process tensors. A memory-backed emptyDir
# replaces it: only what is written counts against the pod's memory, and this caps it.
SHM_SIZE = "16Gi"


def tp_size(spec: Obj) -> int:
    """The scheduler's tensor parallelism: one process per GPU of the pod (1: none)."""
    sched = spec["scheduler"]
    return int(sched["gpusPerReplica"]) if sched["device"] == "cuda" else 1


def downward(var: str, path: str) -> Obj:
    return {"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def grpc_probes(port: int, startup_failures: int, liveness_service: str = "") -> Obj:
    """Startup and readiness ask the server's health ("": NOT_SERVING while draining); liveness asks
    ``liveness_service`` (the scheduler's "liveness": NOT_SERVING when its engine stopped stepping
    with work to do, so the kubelet restarts a hung engine but never a draining pod)."""
    live = {"port": port, "service": liveness_service} if liveness_service else {"port": port}
    return {
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": startup_failures},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"grpc": live, "periodSeconds": 10, "failureThreshold": 6},
    }


def http_probes(port: int) -> Obj:
    get = {"path": "/health", "port": port}
    return {
        "startupProbe": {"httpGet": get, "periodSeconds": 10, "failureThreshold": 90},
        "readinessProbe": {"httpGet": get, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": get, "periodSeconds": 10, "failureThreshold": 6},
    }


def add_shared_memory(pod: Obj, container: Obj) -> None:
    """Mount a memory-backed /dev/shm of :data:`SHM_SIZE` in ``container`` of ``pod`` (a pod spec)."""
    pod["volumes"] = [
        *pod.get("volumes", []),
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
    ]
    # New lists: others (the model's init container) share the old ones and need no /dev/shm.
    container["volumeMounts"] = [
        *container.get("volumeMounts", []),
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
