"""spec.scheduler.kvCache (operator/kv_cache.py): the host tier's memory on the scheduler pod, the disk
tier's volume and the schedulers' settings, built from a spec (pure) and by the real operator against
the API emulator; each broken kvCache refused with a message naming the field."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import jsonschema
import pytest

for _module in ("kopf", "kmock", "pytest_asyncio", "kubernetes"):
    pytest.importorskip(_module, reason=f"the operator e2e tests need {_module} (see docs/development.md)")

from radixserve.common.model_source import parse_quantity  # noqa: E402
from radixserve.operator import crds, kv_cache  # noqa: E402
from radixserve.operator.manifests import config_map, scheduler_statefulset  # noqa: E402
from radixserve.operator.schema import schema_problems  # noqa: E402
from radixserve.operator.validation import validate  # noqa: E402
from tests.operator import emulator  # noqa: E402
from tests.operator.emulator import Harness  # noqa: E402
from tests.operator.objects import CPU, DEPLOY, ISVC, STS, cond, degraded_of, isvc  # noqa: E402
from tests.operator.specs import ctx  # noqa: E402

harness = emulator.harness  # the fixture: kopf running our handlers against a fresh emulator

SIZED = {"requests": {"cpu": "8", "memory": "48Gi"}, "limits": {"memory": "64Gi"}}


def _spec(kv: dict[str, Any], resources: dict[str, Any] | None = None) -> dict[str, Any]:
    scheduler: dict[str, Any] = {**CPU, "kvCache": kv}
    if resources is not None:
        scheduler["resources"] = resources
    return {"model": {"path": "demo"}, "scheduler": scheduler}


def _pod(kv: dict[str, Any], resources: dict[str, Any] | None = None) -> dict[str, Any]:
    built = scheduler_statefulset(ctx(_spec(kv, resources), pool=None))
    return dict(built["spec"]["template"]["spec"])


def test_host_gib_grows_the_memory_request_and_limit_and_reaches_the_schedulers() -> None:
    pod = _pod({"hostGiB": 16, "writePolicy": "write_through"}, SIZED)
    (container,) = pod["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "80Gi"},
    }
    data = config_map(ctx(_spec({"hostGiB": 16, "writePolicy": "write_through"}), pool=None))["data"]
    assert (data["RADIXSERVE_HOST_KV_CACHE_GB"], data["RADIXSERVE_KV_WRITE_POLICY"]) == (
        "16",
        "write_through",
    )
    assert "RADIXSERVE_KV_DISK_CACHE_DIR" not in data  # no disk asked for
    assert all(v["name"] != kv_cache.KV_DISK_VOLUME for v in pod["volumes"])


def test_host_gib_on_the_default_resources_and_on_a_limit_alone() -> None:
    """The default request (16Gi) grows and no limit appears; a fraction of a GiB lands in Mi; a limit
    given alone grows alone (Kubernetes takes the request from it)."""
    (default,) = _pod({"hostGiB": 0.5})["containers"]
    assert default["resources"] == {"requests": {"cpu": "4", "memory": "16896Mi"}}
    (alone,) = _pod({"hostGiB": 8}, {"limits": {"memory": "32G"}})["containers"]
    assert set(alone["resources"]) == {"limits"}
    assert parse_quantity(alone["resources"]["limits"]["memory"]) == 32 * 10**9 + 8 * 2**30
    (zero,) = _pod({"hostGiB": 0}, SIZED)["containers"]  # 0: no host tier, nothing added
    assert zero["resources"] == SIZED
    assert "RADIXSERVE_HOST_KV_CACHE_GB" not in config_map(ctx(_spec({"hostGiB": 0}), pool=None))["data"]


def test_a_tensor_parallel_pod_splits_host_gib_over_its_ranks_and_asks_for_it_once() -> None:
    """Every rank of the pod holds a host pool of --host-kv-cache-gb (its heads' share of the same
    tokens): each is given hostGiB / ranks, and the pod's memory grows by hostGiB."""
    for gpus, hosts, per_rank in [(4, 64, "16"), (3, 20, "6.666666"), (1, 10, "10"), (2, 1, "0.5")]:
        spec = {
            "model": {"path": "demo"},
            "scheduler": {"gpusPerReplica": gpus, "kvCache": {"hostGiB": hosts}},
        }
        pod = scheduler_statefulset(ctx(spec, pool=None))["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["requests"]["memory"] == f"{16 + hosts}Gi"
        assert config_map(ctx(spec, pool=None))["data"]["RADIXSERVE_HOST_KV_CACHE_GB"] == per_rank
    cpu = _spec({"hostGiB": 10})  # one process on CPU: the whole
    assert config_map(ctx(cpu, pool=None))["data"]["RADIXSERVE_HOST_KV_CACHE_GB"] == "10"


@pytest.mark.parametrize(
    ("disk", "volume"),
    [
        ({"emptyDir": {}}, {"emptyDir": {"sizeLimit": "200Gi"}}),
        ({"hostPath": "/mnt/nvme/kv"}, {"hostPath": {"path": "/mnt/nvme/kv", "type": "Directory"}}),
        (
            {"persistentVolumeClaim": {"claimName": "kv-shared"}},
            {"persistentVolumeClaim": {"claimName": "kv-shared"}},
        ),
    ],
    ids=["emptyDir", "hostPath", "pvc"],
)
def test_each_disk_kind_is_a_volume_mounted_in_the_scheduler_with_its_settings(
    disk: dict[str, Any], volume: dict[str, Any]
) -> None:
    kv = {"hostGiB": 32, "disk": {"sizeGiB": 200, **disk}}
    pod = _pod(kv)
    assert {"name": "kv-disk", **volume} in pod["volumes"]
    (container,) = pod["containers"]
    assert {"name": "kv-disk", "mountPath": "/kv-cache"} in container["volumeMounts"]
    for init in pod.get("initContainers", []):  # only the scheduler reads and writes KV
        assert all(m["name"] != "kv-disk" for m in init["volumeMounts"])
    data = config_map(ctx(_spec(kv), pool=None))["data"]
    assert (data["RADIXSERVE_KV_DISK_CACHE_DIR"], data["RADIXSERVE_KV_DISK_CACHE_GB"]) == ("/kv-cache", "200")
    assert data["RADIXSERVE_HOST_KV_CACHE_GB"] == "32"


DISK = "spec.scheduler.kvCache.disk"
PVC = f"{DISK}.persistentVolumeClaim"
SOUND = {"hostGiB": 64, "writePolicy": "write_back", "disk": {"sizeGiB": 500, "hostPath": "/mnt/kv"}}


@pytest.mark.parametrize(
    ("kv", "path"),
    [
        ({"hostGiB": -1}, "spec.scheduler.kvCache.hostGiB"),
        ({"hostGiB": "64Gi"}, "spec.scheduler.kvCache.hostGiB"),
        ({"hostGiB": 8, "writePolicy": "write_around"}, "spec.scheduler.kvCache.writePolicy"),
        ({"hostGiB": 8, "disk": {"sizeGiB": -5, "emptyDir": {}}}, f"{DISK}.sizeGiB"),
        ({"hostGiB": 8, "disk": {"sizeGiB": 0, "emptyDir": {}}}, f"{DISK}.sizeGiB"),
        ({"hostGiB": 8, "disk": {"emptyDir": {}}}, f"{DISK}.sizeGiB"),
        ({"hostGiB": 8, "disk": {"sizeGiB": 5, "persistentVolumeClaim": {}}}, f"{PVC}.claimName"),
    ],
)  # fmt: skip
def test_the_schema_refuses_bad_kv_cache_fields_naming_them(kv: dict[str, Any], path: str) -> None:
    spec = _spec(kv)
    problems = schema_problems(crds.INFERENCE_SERVICE_SPEC, spec)
    assert len(problems) == 1 and problems[0].startswith(f"{path}:"), problems
    assert list(jsonschema.Draft4Validator(crds.INFERENCE_SERVICE_SPEC).iter_errors(spec))  # it agrees
    assert schema_problems(crds.INFERENCE_SERVICE_SPEC, _spec(SOUND)) == []


@pytest.mark.parametrize(
    ("kv", "path"),
    [
        ({"hostGB": 8}, "spec.scheduler.kvCache.hostGB"),
        ({"hostGiB": 8, "disk": {"sizeGiB": 5, "nfs": {}}}, f"{DISK}.nfs"),
        ({"hostGiB": 8, "disk": {"sizeGiB": 5, "emptyDir": {"medium": "Memory"}}}, f"{DISK}.emptyDir.medium"),
    ],
)  # fmt: skip
def test_unknown_kv_cache_fields_are_named_as_typos(kv: dict[str, Any], path: str) -> None:
    """What the API server prunes (or refuses with strict field validation): a typo is not a setting."""
    (problem,) = schema_problems(crds.INFERENCE_SERVICE_SPEC, _spec(kv))
    assert problem.startswith(f"{path}: unknown field"), problem


@pytest.mark.parametrize(
    ("kv", "words"),
    [
        (
            {"hostGiB": 8, "disk": {"sizeGiB": 5, "emptyDir": {}, "hostPath": "/mnt/kv"}},
            "exactly one of emptyDir, hostPath or persistentVolumeClaim (given: emptyDir, hostPath)",
        ),
        (
            {"hostGiB": 8, "disk": {"sizeGiB": 5}},
            "exactly one of emptyDir, hostPath or persistentVolumeClaim",
        ),
        ({"disk": {"sizeGiB": 5, "emptyDir": {}}}, "kvCache.disk needs hostGiB above 0"),
        ({"hostGiB": 0, "disk": {"sizeGiB": 5, "emptyDir": {}}}, "kvCache.disk needs hostGiB above 0"),
        ({"hostGiB": 8, "disk": {"sizeGiB": 5, "hostPath": "kv"}}, "hostPath: 'kv' is not an absolute path"),
    ],
    ids=["two-kinds", "no-kind", "no-host", "host-zero", "relative-path"],
)
def test_what_the_schema_cannot_say_is_refused_by_the_operator_and_by_cel(
    kv: dict[str, Any], words: str
) -> None:
    spec = ctx(_spec(kv), pool=None).spec
    (problem,) = validate(spec, None, "redis://r:6379/0")
    assert problem.reason == "InvalidSpec" and words in problem.message, problem
    assert problem.message.startswith("spec.scheduler.kvCache")
    # The API server says the same with the CRD's CEL rules (checked here only by their messages).
    rules = crds.INFERENCE_SERVICE_SPEC["properties"]["scheduler"]["properties"]["kvCache"]
    messages = [r["message"] for r in rules["x-kubernetes-validations"]]
    messages += [r["message"] for r in rules["properties"]["disk"]["x-kubernetes-validations"]]
    if "absolute" not in words:
        assert any(m in problem.message for m in messages), (problem.message, messages)
    assert validate(ctx(_spec(SOUND), pool=None).spec, None, "redis://r:6379/0") == []


def _cel(rule: str, value: dict[str, Any]) -> bool:
    """The few CEL forms kvCache's rules use (has, field access, ?:, !, ||, &&, +, ==, >), in Python."""
    py = re.sub(r"has\(self\.(\w+)\)", r"('\1' in s)", rule)
    py = re.sub(r"\((\('\w+' in s\)) \? 1 : 0\)", r"(1 if \1 else 0)", py)
    py = re.sub(r"self\.(\w+)", r"s['\1']", py)
    py = py.replace("!(", "not (").replace("||", " or ").replace("&&", " and ")
    return bool(eval(py, {}, {"s": value}))


@pytest.mark.parametrize(
    "kv",
    [
        SOUND,
        {"hostGiB": 8},
        {"disk": {"sizeGiB": 5, "emptyDir": {}}},
        {"hostGiB": 0, "disk": {"sizeGiB": 5, "emptyDir": {}}},
        {"hostGiB": 8, "disk": {"sizeGiB": 5}},
        {"hostGiB": 8, "disk": {"sizeGiB": 5, "emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}},
        {"hostGiB": 8, "disk": {"sizeGiB": 5, "persistentVolumeClaim": {"claimName": "c"}}},
        {"disk": {"sizeGiB": 5}},  # both rules
    ],
)
def test_the_crds_cel_rules_refuse_exactly_what_the_operator_refuses(kv: dict[str, Any]) -> None:
    """A server with CEL and the operator's own check (servers without it, emulators) agree."""
    schema = crds.INFERENCE_SERVICE_SPEC["properties"]["scheduler"]["properties"]["kvCache"]
    checks = [(r, kv) for r in schema["x-kubernetes-validations"]]
    checks += [
        (r, kv["disk"]) for r in schema["properties"]["disk"]["x-kubernetes-validations"] if "disk" in kv
    ]
    cel_refuses = [r["message"] for r, value in checks if not _cel(r["rule"], value)]
    operator_refuses = validate(ctx(_spec(kv), pool=None).spec, None, "redis://r:6379/0")
    assert len(cel_refuses) == len(operator_refuses)
    for message in cel_refuses:
        assert any(message in p.message for p in operator_refuses), (message, operator_refuses)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_operator_builds_a_kv_cache_service_and_refuses_broken_ones(harness: Harness) -> None:
    kv = {"hostGiB": 24, "disk": {"sizeGiB": 100, "persistentVolumeClaim": {"claimName": "kv-shared"}}}
    await harness.call(
        harness.kube.apply, isvc("tiers", scheduler={**CPU, "resources": SIZED, "kvCache": kv})
    )
    sts = await harness.until(lambda: harness.obj(STS, "default", "tiers-scheduler"), what="the schedulers")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "72Gi"},
        "limits": {"memory": "88Gi"},
    }
    assert {"name": "kv-disk", "persistentVolumeClaim": {"claimName": "kv-shared"}} in pod["volumes"]
    assert {"name": "kv-disk", "mountPath": "/kv-cache"} in container["volumeMounts"]
    data = harness.obj("v1/configmaps", "default", "tiers-engine")["data"]
    assert data["RADIXSERVE_HOST_KV_CACHE_GB"] == "24"
    assert (data["RADIXSERVE_KV_DISK_CACHE_DIR"], data["RADIXSERVE_KV_DISK_CACHE_GB"]) == ("/kv-cache", "100")
    assert container["envFrom"] == [{"configMapRef": {"name": "tiers-engine"}}]

    broken = {
        "negative": ({"hostGiB": -4}, "spec.scheduler.kvCache.hostGiB: -4 is below the minimum 0"),
        "twodisks": (
            {
                "hostGiB": 4,
                "disk": {"sizeGiB": 5, "emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}},
            },
            "exactly one of emptyDir, hostPath or persistentVolumeClaim",
        ),
        "nohost": ({"disk": {"sizeGiB": 5, "emptyDir": {}}}, "kvCache.disk needs hostGiB above 0"),
    }
    for name, (bad, _) in broken.items():
        await harness.call(harness.kube.apply, isvc(name, scheduler={**CPU, "kvCache": bad}))
    for name, (_, words) in broken.items():
        degraded = await harness.until(partial(degraded_of, harness, name), what=name)
        assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
        assert words in degraded["message"], degraded["message"]
        assert cond(harness.obj(ISVC, "default", name), "Ready")["status"] == "False"
        assert harness.obj(DEPLOY, "default", f"{name}-gateway") is None
