"""Pure operator logic: defaults, validation, conditions, node pools, autoscaling decisions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jsonschema
import pytest

from radixserve.operator import crds, nodepool, status
from radixserve.operator.scaling import ScalePolicy, Stabilizer, StaticLoadSource, recommend
from radixserve.operator.schema import apply_defaults, schema_problems
from radixserve.operator.validation import Problem, gpu_shortfall, validate
from tests.operator.specs import spec

REPO = Path(__file__).resolve().parents[2]


def test_chart_crds_are_rendered_from_the_python_source() -> None:
    for plural, crd in crds.CRDS.items():
        on_disk = (REPO / "helm/radixserve/crds" / f"{plural}.radixserve.io.yaml").read_text()
        assert on_disk == crds.render(crd), "run: python -m radixserve.operator.crds helm/radixserve/crds"


# crds.CRD_REVISION -> the digest of the CRDs at that revision (their metadata aside).
CRD_DIGESTS = {2: "b16cfa46702b2dac", 3: "8479ea4da371a389", 4: "23e58c998dd0568f", 5: "6469d9025ee73f06"}


def test_a_schema_change_bumps_the_crd_revision() -> None:
    """The operator applies its CRDs only over an older or equal revision (crd_sync): a schema change
    that kept its revision would let an older operator take the new fields away again."""
    body = {k: {**c, "metadata": {"name": c["metadata"]["name"]}} for k, c in crds.CRDS.items()}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    assert CRD_DIGESTS.get(crds.CRD_REVISION) == digest, (
        f"the CRDs changed: bump crds.CRD_REVISION and add {{revision: {digest!r}}} to CRD_DIGESTS"
    )
    for crd in crds.CRDS.values():
        assert crd["metadata"]["annotations"][crds.REVISION_ANNOTATION] == str(crds.CRD_REVISION)


def _nodes(schema: dict, where: str = "") -> list[tuple[str, dict]]:
    out = [(where or "/", schema)]
    for key, sub in schema.get("properties", {}).items():
        out += _nodes(sub, f"{where}/{key}")
    if isinstance(schema.get("items"), dict):
        out += _nodes(schema["items"], f"{where}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _nodes(schema["additionalProperties"], f"{where}{{}}")
    return out


def test_crd_schemas_are_structural_and_their_defaults_valid() -> None:
    """What the API server demands of a v1 CRD beyond its own schema (kubernetes-validate checks that)."""
    for crd in crds.CRDS.values():
        root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for where, node in _nodes(root):
            assert node.get("type"), f"{where}: every node needs a type"
            assert not ("properties" in node and "additionalProperties" in node), where
            if "default" in node:
                jsonschema.Draft4Validator(node).validate(apply_defaults(node, node["default"]))


def test_defaults_fill_nested_fields_like_the_api_server() -> None:
    s = spec()
    assert s["scheduler"] == {
        "replicas": 1,
        "device": "cuda",
        "gpusPerReplica": 1,
        "drainTimeoutSeconds": 30,
        "engine": {},
        "autoscaling": {  # no mode: off, unless the deprecated autoscaling.enabled says operator
            "minReplicas": 1,
            "maxReplicas": 4,
            "targetWaitingPerReplica": 8,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 300,
        },
    }
    assert s["redis"] == {"mode": "chart"} and s["routing"]["blockSize"] == 16
    assert s["autoscaling"]["enabled"] is False and s["tracing"]["sampleRatio"] == 0.1
    assert spec(scheduler={"replicas": 3})["scheduler"]["replicas"] == 3


@pytest.mark.parametrize(
    ("kw", "pool", "reason", "words"),
    [
        ({"scheduler": {"gpusPerReplica": 0}}, None, "InvalidSpec", "gpusPerReplica is 0"),
        ({"scheduler": {"device": "cpu"}}, None, "InvalidSpec", "device is cpu"),
        ({"scheduler": {"nodePool": "x"}}, None, "UnknownNodePool", "'x' does not exist"),
        ({"model": {}}, None, "InvalidModel", "exactly one of path or source"),
        (
            {"model": {"source": {"pvc": {"claimName": "a"}, "hub": {"id": "b"}}}},
            None,
            "InvalidModel",
            "pvc or hub",
        ),
        ({"redis": {"mode": "external"}}, None, "InvalidSpec", "urlSecretRef"),
        (
            {"redis": {"mode": "none"}, "tokenizer": {"replicas": 2}},
            None,
            "InvalidSpec",
            "tokenizer.replicas must be 1",
        ),
        (
            {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
            None,
            "InvalidSpec",
            "minReplicas",
        ),
        (
            {"autoscaling": {"enabled": True}, "redis": {"mode": "none"}},
            None,
            "InvalidSpec",
            "reads scheduler load",
        ),
    ],
)
def test_contradictions_become_problems_not_exceptions(
    kw: dict, pool: dict | None, reason: str, words: str
) -> None:
    problems = validate(spec(**kw), pool, "redis://r")
    assert problems and problems[0].reason == reason and words in problems[0].message


def test_a_sound_spec_has_no_problems_and_chart_redis_must_exist() -> None:
    assert validate(spec(), None, "redis://r") == []
    assert validate(spec(scheduler={"nodePool": "p"}), {"nodeSelector": {"gpu": "a"}}, "redis://r") == []
    assert validate(spec(), None, "")[0].message.startswith("redis.mode is chart")


def test_gpu_shortfall_counts_other_services_and_waits_for_a_first_count() -> None:
    pool_status = {"gpus": {"total": 16, "allocatable": 16, "requested": 8}}
    assert gpu_shortfall(8, pool_status, requested_by_others=8) is None
    assert (
        gpu_shortfall(16, pool_status, requested_by_others=8)
        == "needs 16 GPUs but the pool has 8 free of 16 allocatable"
    )
    assert gpu_shortfall(100, {}, 0) is None


def test_conditions_say_why_and_keep_their_transition_time() -> None:
    first = status.service_conditions([], None, {"gateway": 0}, {"gateway": 1}, 1, None, now="t0")
    by = {c["type"]: c for c in first}
    assert (by["Ready"]["status"], by["Progressing"]["reason"]) == ("False", "RollingOut")
    second = status.service_conditions([], None, {"gateway": 1}, {"gateway": 1}, 1, first, now="t1")
    by2 = {c["type"]: c for c in second}
    assert by2["Ready"] == {**by2["Ready"], "status": "True", "lastTransitionTime": "t1"}
    assert by2["Degraded"]["lastTransitionTime"] == "t0"  # still False: unchanged
    bad = status.service_conditions([Problem("UnknownNodePool", "gone")], None, {}, {}, 2, second, now="t2")
    assert {c["type"]: (c["status"], c["reason"]) for c in bad} == {
        "Ready": ("False", "UnknownNodePool"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "UnknownNodePool"),
    }
    short = status.service_conditions([], "needs 9 GPUs", {"s": 0}, {"s": 1}, 2, None, now="t3")
    assert short[2]["reason"] == "InsufficientGPUs" and short[2]["message"] == "needs 9 GPUs"


HEADS = "tp_size 8 does not divide the model's 28 attention heads"


def sched_pod(name: str, *statuses: dict, init: tuple[dict, ...] = (), **meta: object) -> dict:
    return {
        "metadata": {"name": name, **meta},
        "status": {"containerStatuses": list(statuses), "initContainerStatuses": list(init)},
    }


def crashed(message: str, code: int = 1, now: bool = False, ready: bool = False) -> dict:
    done = {"terminated": {"exitCode": code, "reason": "Error", "message": message}}
    waiting = {"waiting": {"reason": "CrashLoopBackOff"}}
    return {
        "name": "scheduler",
        "ready": ready,
        "state": done if now else ({"running": {}} if ready else waiting),
        "lastState": {} if now else done,
    }


def test_a_scheduler_that_exits_saying_why_is_the_failure() -> None:
    assert status.scheduler_failure([]) is None
    assert status.scheduler_failure([sched_pod("s-0", {"name": "scheduler", "ready": True})]) is None
    # The message, from the container's last run (crash loop) or its current one (just exited).
    for cs in (crashed(HEADS), crashed(HEADS, now=True)):
        got = status.scheduler_failure([sched_pod("llm-scheduler-0", cs)])
        assert got == f"pod llm-scheduler-0 container scheduler exited with code 1: {HEADS}"
    # Exit 0, no message, a pod serving again after an earlier crash, a pod on its way out: no failure.
    assert status.scheduler_failure([sched_pod("s-0", crashed(HEADS, code=0))]) is None
    assert status.scheduler_failure([sched_pod("s-0", crashed("  "))]) is None
    assert status.scheduler_failure([sched_pod("s-0", crashed(HEADS, ready=True))]) is None
    gone = sched_pod("s-0", crashed(HEADS), deletionTimestamp="2024-01-01T00:00:00Z")
    assert status.scheduler_failure([gone]) is None
    # Several failing pods: the first by name speaks, with a count; an init container counts too.
    pods = [
        sched_pod("s-1", crashed("other")),
        sched_pod("s-0", init=({**crashed("no token"), "name": "fetch-model"},)),
        sched_pod("s-2", {"name": "scheduler", "ready": True}),
    ]
    assert status.scheduler_failure(pods) == (
        "pod s-0 container fetch-model exited with code 1 (2 scheduler pods are failing): no token"
    )
    # A long message (logs, with FallbackToLogsOnError) keeps its end, where the error is.
    long = "x" * 5000 + "ValueError: the end"
    got = status.scheduler_failure([sched_pod("s-0", crashed(long))])
    assert got == "pod s-0 container scheduler exited with code 1: ..." + long[-(status.MESSAGE_LIMIT - 3) :]


def test_a_failing_scheduler_makes_the_service_degraded_with_its_message() -> None:
    failure = f"pod s-0 container scheduler exited with code 1: {HEADS}"
    conds = status.service_conditions([], None, {"scheduler": 0}, {"scheduler": 1}, 3, None, "t0", failure)
    by = {c["type"]: c for c in conds}
    assert (by["Degraded"]["status"], by["Degraded"]["reason"]) == ("True", "SchedulerFailed")
    assert by["Degraded"]["message"] == failure
    assert (by["Ready"]["status"], by["Ready"]["reason"]) == ("False", "SchedulerFailed")
    assert by["Progressing"]["reason"] == "RollingOut"
    # It outranks a GPU shortfall; an invalid spec outranks it.
    short = status.service_conditions([], "needs 9 GPUs", {}, {}, 3, None, "t0", failure)
    assert short[2]["reason"] == "SchedulerFailed"
    bad = status.service_conditions([Problem("InvalidSpec", "no")], None, {}, {}, 3, None, "t0", failure)
    assert bad[2]["reason"] == "InvalidSpec"


def test_node_join_and_leave_patches_keep_foreign_taints() -> None:
    taint = {"key": "radixserve.io/inference", "value": "true", "effect": "NoSchedule"}
    node = {
        "metadata": {"name": "n", "labels": {"gpu": "a"}},
        "spec": {"taints": [{"key": "o", "effect": "NoExecute"}]},
    }
    assert nodepool.node_matches(node, {"gpu": "a"}) and not nodepool.node_matches(node, {})
    join = nodepool.join_patch(node, "p", taint)
    assert join == {
        "metadata": {"labels": {"radixserve.io/gpu-node-pool": "p"}},
        "spec": {"taints": [{"key": "o", "effect": "NoExecute"}, taint]},
    }
    joined = {
        "metadata": {"name": "n", "labels": {"gpu": "a", "radixserve.io/gpu-node-pool": "p"}},
        "spec": join["spec"],
    }
    assert nodepool.join_patch(joined, "p", taint) is None  # idempotent
    assert nodepool.leave_patch(joined, "other-pool", taint) is None  # not ours to release
    assert nodepool.leave_patch(joined, "p", taint) == {
        "metadata": {"labels": {"radixserve.io/gpu-node-pool": None}},
        "spec": {"taints": [{"key": "o", "effect": "NoExecute"}]},
    }


def test_pool_status_counts_ready_nodes_and_live_pods() -> None:
    def n(name: str, gpus: str, ready: bool) -> dict:
        cond = [{"type": "Ready", "status": "True" if ready else "False"}]
        res = {"nvidia.com/gpu": gpus}
        return {
            "metadata": {"name": name},
            "status": {"capacity": res, "allocatable": res, "conditions": cond},
        }

    pods = [
        {
            "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": 2}}}]},
            "status": {"phase": "Running"},
        },
        {
            "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}]},
            "status": {"phase": "Failed"},
        },
    ]
    requested = sum(nodepool.pod_gpus(p, "nvidia.com/gpu") for p in pods)
    st = nodepool.pool_status([n("b", "8", True), n("a", "8", False)], "nvidia.com/gpu", requested)
    assert st == {
        "nodes": 2,
        "readyNodes": 1,
        "nodeNames": ["a", "b"],
        "gpus": {"total": 16, "allocatable": 8, "requested": 2},
    }


POLICY = ScalePolicy(min_replicas=1, max_replicas=4, target_waiting=4, up_window_s=10, down_window_s=60)


def test_recommendation_is_waiting_over_target_within_bounds() -> None:
    assert recommend({}, POLICY) is None  # no heartbeats: do not guess
    assert recommend({"a": {"waiting": 9}, "b": {"waiting": 0}}, POLICY) == 3
    assert recommend({"a": {"waiting": 100}}, POLICY) == 4
    assert recommend({"a": {"waiting": 0}}, POLICY) == 1


def test_stabilizer_needs_a_lasting_spike_and_a_lasting_lull() -> None:
    s = Stabilizer()
    assert s.decide(1, 1, now=0, policy=POLICY) == 1
    assert s.decide(1, 4, now=5, policy=POLICY) == 1  # the 1 at t=0 is still in the 10 s window
    assert s.decide(1, 4, now=11, policy=POLICY) == 4  # every recommendation of the window says 4
    assert s.decide(4, 1, now=30, policy=POLICY) == 4  # a lull must last 60 s
    assert s.decide(4, 1, now=72, policy=POLICY) == 1


def test_static_load_source_filters_by_service_domain() -> None:
    src = StaticLoadSource({"a-0.a.ns.svc:50051": {"waiting": 1}, "b-0.b.ns.svc:50051": {"waiting": 2}})
    assert src.loads(".a.ns.svc") == {"a-0.a.ns.svc:50051": {"waiting": 1}}


@pytest.mark.parametrize(
    ("spec_", "path"),
    [
        ({"model": {"path": "demo"}, "scheduler": {"replicas": -1}}, "spec.scheduler.replicas"),
        ({"model": {"path": "demo"}, "scheduler": {"replicas": "2"}}, "spec.scheduler.replicas"),
        ({"model": {"path": "demo"}, "scheduler": {"device": "tpu"}}, "spec.scheduler.device"),
        ({"model": {"path": "demo", "quantization": "awq"}}, "spec.model.quantization"),
        ({"model": {"source": {"hub": {"id": 3}}}}, "spec.model.source.hub.id"),
        (
            {"model": {"path": "demo"}, "routing": {"balanceRelThreshold": 0.5}},
            "spec.routing.balanceRelThreshold",
        ),
        (
            {"model": {"path": "demo"}, "scheduler": {"engine": {"memFraction": 0}}},
            "spec.scheduler.engine.memFraction",
        ),
    ],
)
def test_the_operators_schema_check_flags_what_the_api_server_would(spec_: dict, path: str) -> None:
    problems = schema_problems(crds.INFERENCE_SERVICE_SPEC, spec_)
    assert len(problems) == 1 and problems[0].startswith(f"{path}:"), problems
    assert list(jsonschema.Draft4Validator(crds.INFERENCE_SERVICE_SPEC).iter_errors(spec_))  # it agrees


def test_the_operators_schema_check_passes_sound_specs_and_names_unknown_fields() -> None:
    sound = {
        "model": {"source": {"pvc": {"claimName": "models", "subPath": "llama"}}},
        "scheduler": {
            "replicas": 2,
            "gpusPerReplica": 1,
            "nodePool": "h100",
            "resources": {"limits": {"x": 1}},
        },
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8, "targetWaitingPerReplica": 8},
    }
    assert schema_problems(crds.INFERENCE_SERVICE_SPEC, sound) == []
    assert (
        schema_problems(crds.INFERENCE_SERVICE_SPEC, apply_defaults(crds.INFERENCE_SERVICE_SPEC, sound)) == []
    )
    typo = {**sound, "scheduler": {"replcas": 2}}
    (problem,) = schema_problems(crds.INFERENCE_SERVICE_SPEC, typo)
    assert problem.startswith("spec.scheduler.replcas: unknown field") and "replicas" in problem


def test_pod_trouble_names_the_most_specific_reason_of_the_first_pod():
    def pod(name: str, *statuses: dict, conditions: tuple[dict, ...] = (), **meta: object) -> dict:
        p = sched_pod(name, *statuses, **meta)
        p["status"]["conditions"] = list(conditions)
        return p

    oom = {
        "name": "scheduler",
        "ready": False,
        "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
    }
    loop = {"name": "gateway", "ready": False, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}}}  # fmt: skip
    pull = {
        "name": "gateway",
        "ready": False,
        "image": "r/x:1",
        "state": {"waiting": {"reason": "ErrImagePull"}},
    }
    unplaced = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "no GPU node",
    }
    assert status.pod_trouble([]) is None
    assert status.pod_trouble([pod("a", {**oom, "ready": True})]) is None  # serving again
    assert status.pod_trouble([pod("a", oom, deletionTimestamp="t")]) is None  # on its way out
    assert status.pod_trouble([pod("a", loop)]) == (
        "CrashLoopBackOff",
        "pod a: container gateway keeps exiting (last exit code 2)",
    )
    assert status.pod_trouble([pod("a", oom)])[0] == "OOMKilled"
    assert status.pod_trouble([pod("a", pull)]) == (
        "ImagePullBackOff",
        "pod a: container gateway (r/x:1): ErrImagePull",
    )
    # most specific first, across pods: unschedulable, then image pulls, memory, crash loops
    pods = [pod("a", loop), pod("b", oom), pod("c", pull), pod("d", conditions=(unplaced,))]
    assert status.pod_trouble(pods) == ("Unschedulable", "pod d: no GPU node")
    assert status.pod_trouble(pods[:3])[0] == "ImagePullBackOff"
    assert status.pod_trouble(pods[:2])[0] == "OOMKilled"
    # it makes the service Degraded (after spec problems, failures and GPU shortfalls) and not Ready
    conds = status.service_conditions(
        [], None, {"s": 0}, {"s": 1}, 1, None, now="t", trouble=("OOMKilled", "m")
    )
    by_type = {c["type"]: c for c in conds}
    assert by_type["Degraded"]["reason"] == by_type["Ready"]["reason"] == "OOMKilled"
    short = status.service_conditions(
        [], "needs 2 GPUs", {"s": 0}, {"s": 1}, 1, None, now="t", trouble=("Unschedulable", "m")
    )
    assert {c["type"]: c for c in short}["Degraded"]["reason"] == "InsufficientGPUs"
