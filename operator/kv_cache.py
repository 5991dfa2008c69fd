"""spec.scheduler.kvCache: the schedulers' KV tiers below the GPU (docs/architecture.md, "KV tiers").

    kvCache:
      hostGiB: 64              # --host-kv-cache-gb: host memory for KV evicted from the GPU
      writePolicy: write_back  # --kv-write-policy (write_back | write_through)
      disk:                    # --kv-disk-cache-dir / --kv-disk-cache-gb, under the host tier
        sizeGiB: 500
        emptyDir: {}                                  # the pod's own, gone with it; or
        hostPath: /mnt/nvme/kv                        # a node's local disk; or
        persistentVolumeClaim: {claimName: kv-shared} # ReadWriteMany: one directory many pods share

The host tier is pinned memory in the scheduler's processes, so ``hostGiB`` is added to the scheduler
container's memory request, and to its limit where it has one (:func:`grow_memory`): a pod sized for
its weights and runtime keeps that room and gets the tier on top. ``hostGiB`` is the pod's: a
tensor-parallel pod's ranks each hold their heads' share of the same tokens, and each sizes its pool
by ``--host-kv-cache-gb``, so each is given ``hostGiB / ranks`` (:func:`settings`).

The disk is a volume mounted at :data:`KV_DISK_DIR` in the scheduler container; the schedulers read
where and how much from the ConfigMap's RADIXSERVE_KV_DISK_CACHE_DIR / RADIXSERVE_KV_DISK_CACHE_GB.
"""

from __future__ import annotations

import math

from radixserve.common.config import env_var
from radixserve.common.model_source import parse_quantity
from radixserve.common.service_config import KV_WRITE_POLICIES, SchedulerPodConfig
from radixserve.operator.objects import Obj
from radixserve.operator.pods import tp_size
from radixserve.operator.schema import Schema, obj, string

KV_DISK_DIR = "/kv-cache"  # where the disk tier's volume is mounted in the scheduler container
KV_DISK_VOLUME = "kv-disk"
_GIB = 2**30
_DISK_KINDS = ("emptyDir", "hostPath", "persistentVolumeClaim")

ONE_DISK_MESSAGE = "kvCache.disk needs exactly one of emptyDir, hostPath or persistentVolumeClaim"
DISK_NEEDS_HOST_MESSAGE = (
    "kvCache.disk needs hostGiB above 0: KV reaches the disk from the host tier and comes back through it"
)

_DISK_SCHEMA = obj(
    {
        "sizeGiB": {
            "type": "number",
            "minimum": 0,
            "exclusiveMinimum": True,
            "description": "what the disk tier may hold (--kv-disk-cache-gb); an emptyDir's size limit too",
        },
        "emptyDir": obj(
            {}, description="the pod's own scratch space (its node's disk): gone when the pod goes"
        ),
        "hostPath": string(
            minLength=1,
            description="a folder on the node (a local NVMe), writable by uid 1000: a pod restarted on "
            "the same node starts warm from what it wrote",
        ),
        "persistentVolumeClaim": obj(
            {"claimName": string(minLength=1)},
            required=["claimName"],
            description="a claim in the service's namespace; ReadWriteMany for a directory the "
            "schedulers share (any of them loads what another wrote)",
        ),
    },
    required=["sizeGiB"],
    description="A disk tier under the host tier, in a volume mounted in the scheduler pods: exactly "
    "one of emptyDir, hostPath or persistentVolumeClaim.",
) | {
    "x-kubernetes-validations": [
        {
            "rule": " + ".join(f"(has(self.{k}) ? 1 : 0)" for k in _DISK_KINDS) + " == 1",
            "message": ONE_DISK_MESSAGE,
        }
    ]
}

KV_CACHE_SCHEMA: Schema = obj(
    {
        "hostGiB": {
            "type": "number",
            "minimum": 0,
            "description": "GiB of host memory per scheduler pod for KV evicted from the GPU "
            "(--host-kv-cache-gb, split over a tensor-parallel pod's ranks; 0 or unset: none); added "
            "to the pod's memory request and limit",
        },
        "writePolicy": string(
            enum=list(KV_WRITE_POLICIES),
            description="write_back (the default): KV is copied to the host when the GPU evicts it; "
            "write_through: when it is cached (eviction costs no copy, every prefix costs one)",
        ),
        "disk": _DISK_SCHEMA,
    },
    description="KV cache tiers below the GPU: host memory, then a disk.",
) | {
    "x-kubernetes-validations": [
        {
            "rule": "!has(self.disk) || (has(self.hostGiB) && self.hostGiB > 0)",
            "message": DISK_NEEDS_HOST_MESSAGE,
        }
    ]
}


def _kv_cache(spec: Obj) -> Obj:
    return spec["scheduler"].get("kvCache") or {}


def problems(spec: Obj) -> list[str]:
    """What the CRD's CEL rules refuse in the defaulted ``spec``'s kvCache (for servers without CEL,
    and emulators), and what they cannot check (a relative hostPath)."""
    kv = _kv_cache(spec)
    disk = kv.get("disk")
    if disk is None:
        return []
    out = []
    kinds = [k for k in _DISK_KINDS if k in disk]
    if len(kinds) != 1:
        given = f" (given: {', '.join(kinds)})" if kinds else ""
        out.append(f"spec.scheduler.{ONE_DISK_MESSAGE}{given}")
    if not float(kv.get("hostGiB") or 0) > 0:
        out.append(f"spec.scheduler.{DISK_NEEDS_HOST_MESSAGE}")
    path = disk.get("hostPath")
    if path is not None and not str(path).startswith("/"):
        out.append(f"spec.scheduler.kvCache.disk.hostPath: {path!r} is not an absolute path")
    return out


def _gb(value: float) -> str:
    """A GiB figure for a --*-gb setting: 64 rather than 64.0; never above ``value`` (rounded down to
    a millionth: a rank's share of a pod's GiB)."""
    return f"{math.floor(value * 1e6) / 1e6:.6f}".rstrip("0").rstrip(".")


def settings(spec: Obj) -> dict[str, str]:
    """The ConfigMap's variables for the schedulers' tiers (none without kvCache)."""
    kv = _kv_cache(spec)
    out: dict[str, str] = {}
    if kv.get("hostGiB"):  # each rank's share: every rank of the pod holds a pool of this size
        out[env_var(SchedulerPodConfig, "host_kv_cache_gb")] = _gb(float(kv["hostGiB"]) / tp_size(spec))
    if kv.get("writePolicy"):
        out[env_var(SchedulerPodConfig, "kv_write_policy")] = kv["writePolicy"]
    if kv.get("disk"):
        out[env_var(SchedulerPodConfig, "kv_disk_cache_dir")] = KV_DISK_DIR
        out[env_var(SchedulerPodConfig, "kv_disk_cache_gb")] = _gb(float(kv["disk"]["sizeGiB"]))
    return out


def quantity(size: int) -> str:
    """``size`` bytes as a Kubernetes quantity, in the largest binary unit that holds it whole."""
    for unit, scale in (("Ti", 2**40), ("Gi", _GIB), ("Mi", 2**20), ("Ki", 2**10)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _gib_bytes(gib: float) -> int:
    return math.ceil(gib * _GIB)


def grow_memory(resources: Obj, spec: Obj) -> None:
    """Add the host tier's ``hostGiB`` to ``resources``' memory request and to its memory limit where
    it has one (the container's resources, changed in place). A limit alone stays alone: Kubernetes
    takes the request from it. No limit is added where there was none."""
    host = float(_kv_cache(spec).get("hostGiB") or 0)
    if host <= 0:
        return
    extra = _gib_bytes(host)
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    if "memory" in limits:
        limits["memory"] = quantity(parse_quantity(limits["memory"]) + extra)
    if "memory" in requests:
        requests["memory"] = quantity(parse_quantity(requests["memory"]) + extra)
    elif "memory" not in limits:
        requests["memory"] = quantity(extra)
    if requests:
        resources["requests"] = requests


def add_disk(pod: Obj, container: Obj, spec: Obj) -> None:
    """Mount the disk tier's volume at :data:`KV_DISK_DIR` in ``container`` of ``pod`` (a pod spec)."""
    disk = _kv_cache(spec).get("disk")
    if not disk:
        return
    source: Obj
    if "persistentVolumeClaim" in disk:
        source = {"persistentVolumeClaim": {"claimName": disk["persistentVolumeClaim"]["claimName"]}}
    elif "hostPath" in disk:
        # Directory, not DirectoryOrCreate: the kubelet would create it as root, which the scheduler
        # (uid 1000; fsGroup does not apply to hostPath) could not write. Pre-create it, owned by 1000.
        source = {"hostPath": {"path": disk["hostPath"], "type": "Directory"}}
    else:  # the kubelet evicts a pod whose emptyDir outgrows its limit: the tier stays below it
        source = {"emptyDir": {"sizeLimit": quantity(_gib_bytes(float(disk["sizeGiB"])))}}
    pod["volumes"] = [*pod.get("volumes", []), {"name": KV_DISK_VOLUME, **source}]
    # A new list: the model's init container shares the old one and needs no KV.
    container["volumeMounts"] = [
        *container.get("volumeMounts", []),
        {"name": KV_DISK_VOLUME, "mountPath": KV_DISK_DIR},
    ]
