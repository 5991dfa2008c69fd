"""Who scales the schedulers (scheduler.autoscaling.mode off / operator / external), what the
StatefulSet and the gateways get in each mode, and the scale subresource HPA and KEDA use (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.operator import crds
from radixserve.operator.manifests import build_all, gateway_deployment, scheduler_statefulset
from radixserve.operator.scaling import autoscaling, scheduler_replicas
from radixserve.operator.scheduler_scale import replicas_release
from radixserve.operator.validation import validate
from tests.operator.specs import SPEC, ctx, spec

AUTO = {"minReplicas": 1, "maxReplicas": 6, "targetWaitingPerReplica": 4}


@pytest.mark.parametrize(
    ("fields", "mode", "settings_from"),
    [
        ({}, "off", "scheduler.autoscaling"),
        ({"scheduler": {"autoscaling": {"mode": "operator", **AUTO}}}, "operator", "scheduler.autoscaling"),
        ({"scheduler": {"autoscaling": {"mode": "external"}}}, "external", "scheduler.autoscaling"),
        # the deprecated field keeps working for objects written before the new one
        ({"autoscaling": {"enabled": True, **AUTO}}, "operator", "autoscaling"),
        ({"autoscaling": {"enabled": False}}, "off", "scheduler.autoscaling"),
    ],
)
def test_the_mode_comes_from_scheduler_autoscaling_or_the_deprecated_field(
    fields: dict[str, Any], mode: str, settings_from: str
) -> None:
    auto = autoscaling(spec(**fields))
    assert (auto.mode, auto.field) == (mode, settings_from)
    if mode == "operator":
        assert auto.settings["maxReplicas"] == 6 and auto.settings["scaleDownStabilizationSeconds"] == 300


def test_the_count_in_force_per_mode() -> None:
    sched = {"replicas": 2}
    assert scheduler_replicas(spec(scheduler=sched), {"schedulerReplicas": 7}) == 2  # off: the spec's
    operator = spec(scheduler={**sched, "autoscaling": {"mode": "operator", **AUTO}})
    assert scheduler_replicas(operator, {"autoscaling": {"desiredReplicas": 9}}) == 6  # within bounds
    assert scheduler_replicas(operator, {}) == 2  # no decision yet: the spec's
    external = spec(scheduler={**sched, "autoscaling": {"mode": "external"}})
    assert scheduler_replicas(external, {"schedulerReplicas": 7}) == 7  # what the StatefulSet had
    assert scheduler_replicas(external, {}) == 2


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"scheduler": {"autoscaling": {"mode": "external"}}, "redis": {"mode": "none"}}, "mode external"),
        (
            {"scheduler": {"autoscaling": {"mode": "operator"}}, "redis": {"mode": "none"}},
            "reads scheduler load",
        ),
        (
            {"scheduler": {"autoscaling": {"mode": "operator", "minReplicas": 5, "maxReplicas": 2}}},
            "scheduler.autoscaling.minReplicas is greater",
        ),
        (
            {"scheduler": {"autoscaling": {"mode": "operator"}}, "autoscaling": {"enabled": True}},
            "remove autoscaling",
        ),
    ],
)
def test_modes_that_cannot_work_are_problems(fields: dict[str, Any], words: str) -> None:
    problems = validate(spec(**fields), None, "redis://r")
    assert problems and problems[0].reason == "InvalidSpec" and words in problems[0].message, problems


def test_external_mode_needs_no_scheduler_replicas_in_the_spec_and_off_mode_does() -> None:
    external = {"replicas": 0, "autoscaling": {"mode": "external"}}
    assert validate(spec(scheduler=external), None, "redis://r") == []
    assert (
        "scheduler.replicas must be at least 1"
        in validate(spec(scheduler={"replicas": 0}), None, "r")[0].message
    )


def test_external_mode_applies_the_statefulset_without_replicas() -> None:
    for mode, has_replicas in [("off", True), ("operator", True), ("external", False)]:
        s = {**SPEC, "scheduler": {**SPEC["scheduler"], "autoscaling": {"mode": mode}}}
        sts = scheduler_statefulset(ctx(s, replicas=3))
        assert ("replicas" in sts["spec"]) == has_replicas, mode
        if has_replicas:
            assert sts["spec"]["replicas"] == 3


def test_with_redis_a_scale_change_leaves_the_gateway_as_it_was() -> None:
    for redis in ({"mode": "chart"}, {"mode": "external", "urlSecretRef": {"name": "u"}}):
        s = {**SPEC, "redis": redis}
        assert gateway_deployment(ctx(s, replicas=1)) == gateway_deployment(ctx(s, replicas=5))
    # Without Redis the gateway lists the schedulers: it changes (and rolls) with their count.
    none = {**SPEC, "redis": {"mode": "none"}}
    two = gateway_deployment(ctx(none, replicas=2))["spec"]["template"]["spec"]["containers"][0]["env"]
    listed = next(e["value"] for e in two if e["name"] == "RADIXSERVE_SCHEDULERS").split()
    assert listed == [f"llm-scheduler-{i}.llm-scheduler.prod.svc:50051" for i in range(2)]
    assert gateway_deployment(ctx(none, replicas=2)) != gateway_deployment(ctx(none, replicas=3))


def test_the_crd_has_a_scale_subresource_on_the_scheduler_count() -> None:
    version = crds.INFERENCE_SERVICE_CRD["spec"]["versions"][0]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.scheduler.replicas",
            "statusReplicasPath": ".status.schedulerReplicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["selector"]["type"] == "string" and status["schedulerReplicas"]["type"] == "integer"
    # What the selector will say matches the scheduler pods the StatefulSet makes.
    sts = next(o for o in build_all(ctx()) if o["kind"] == "StatefulSet")
    assert (
        sts["spec"]["selector"]["matchLabels"].items()
        <= sts["spec"]["template"]["metadata"]["labels"].items()
    )


def managed(manager: str, operation: str, spec_fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "manager": manager,
        "operation": operation,
        "apiVersion": "apps/v1",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": spec_fields},
    }


def test_switching_to_external_drops_only_the_operators_claim_on_replicas() -> None:
    ours = managed("radixserve-operator", "Apply", {"f:replicas": {}, "f:template": {}})
    hpa = managed("kube-controller-manager", "Update", {"f:replicas": {}})
    status_writer = managed("radixserve-operator", "Update", {"f:replicas": {}})  # not an apply: not ours
    live = {"metadata": {"resourceVersion": "42", "managedFields": [ours, hpa, status_writer]}}
    patch = replicas_release(live)
    assert patch == {
        "metadata": {
            "resourceVersion": "42",  # a write in between makes the patch fail, not lose a claim
            "managedFields": [
                managed("radixserve-operator", "Apply", {"f:template": {}}),
                hpa,
                status_writer,
            ],
        }
    }
    assert live["metadata"]["managedFields"][0] == ours  # the input is left as it was
    released = {"metadata": {"resourceVersion": "43", "managedFields": patch["metadata"]["managedFields"]}}
    assert replicas_release(released) is None  # nothing left to release
    assert replicas_release({"metadata": {}}) is None  # an API without managedFields (the emulator)


# ----------------------------------------------------------------------------- scale to zero
ZERO = {"mode": "operator", "minReplicas": 0, "maxReplicas": 3, "scaleToZeroAfter": 60}
HOLD = {"holdTimeoutSeconds": 120, "maxHeldRequests": 64}
SCHED = "llm-scheduler-0.llm-scheduler.prod.svc:50051"


def _zero_ctx(replicas: int, auto: dict[str, Any] = ZERO) -> Any:
    return ctx({**SPEC, "scheduler": {**SPEC["scheduler"], "autoscaling": auto}, "tokenizer": HOLD}, replicas)


def test_held_requests_bring_the_schedulers_from_zero_and_idle_takes_them_back() -> None:
    from radixserve.operator.scaling import Stabilizer, StaticLoadSource
    from radixserve.operator.scheduler_scale import autoscale

    source, stab = StaticLoadSource(), Stabilizer()
    # At zero nothing waits anywhere: it stays at zero (no scheduler heartbeats, no held requests).
    source.by_gateway = {"10.0.0.5:50050": {"held": 0, "in_flight": 0}}
    assert autoscale(_zero_ctx(0), source, stab, {}, now=0)[0] == 0
    # A gateway holds a request: to minReplicas-at-load (1) at once, no stabilization window.
    source.by_gateway["10.0.0.5:50050"] = {"held": 3, "in_flight": 0}
    n, decision, said = autoscale(_zero_ctx(0), source, stab, {}, now=1)
    assert n == 1 and decision["held"] == 3 and "0 -> 1 (3 requests held" in said
    # Serving: requests keep the idle clock at zero.
    source.by_gateway["10.0.0.5:50050"] = {"held": 0, "in_flight": 2}
    source.by_pod = {SCHED: {"waiting": 0, "running": 2}}
    assert autoscale(_zero_ctx(1), source, stab, {}, now=30)[0] == 1
    source.by_gateway["10.0.0.5:50050"] = {"held": 0, "in_flight": 0}
    source.by_pod = {SCHED: {"waiting": 0, "running": 0}}
    assert autoscale(_zero_ctx(1), source, stab, {}, now=89)[0] == 1  # idle 59 s < 60
    n, decision, said = autoscale(_zero_ctx(1), source, stab, {}, now=91)
    assert n == 0 and decision["desiredReplicas"] == 0 and "no requests for 61 s" in said
    # The decision holds through the count in force (status), not clamped back to 1.
    zero = spec(scheduler={"replicas": 1, "autoscaling": ZERO}, tokenizer=HOLD)
    assert scheduler_replicas(zero, {"autoscaling": {"desiredReplicas": 0}}) == 0


def test_never_below_one_without_scale_to_zero_after() -> None:
    from radixserve.operator.scaling import Stabilizer, StaticLoadSource
    from radixserve.operator.scheduler_scale import autoscale

    auto = {"mode": "operator", "minReplicas": 1, "maxReplicas": 3, "scaleDownStabilizationSeconds": 0}
    source, stab = StaticLoadSource(by_pod={SCHED: {"waiting": 0, "running": 0}}), Stabilizer()
    for now in (0, 1000, 100_000):  # idle for days: still one
        assert autoscale(_zero_ctx(1, auto), source, stab, {}, now=now)[0] == 1
    plain = spec(scheduler={"replicas": 1, "autoscaling": auto})
    assert scheduler_replicas(plain, {"autoscaling": {"desiredReplicas": 0}}) == 1


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            {"scheduler": {"autoscaling": {**ZERO, "scaleToZeroAfter": None}}, "tokenizer": HOLD},
            "minReplicas 0 needs scaleToZeroAfter",
        ),
        ({"scheduler": {"autoscaling": ZERO}}, "need tokenizer.holdTimeoutSeconds above 0"),
        (
            {"scheduler": {"autoscaling": {"mode": "external", "scaleToZeroAfter": 60}}, "tokenizer": HOLD},
            "scaleToZeroAfter is the built-in autoscaler's: mode is external",
        ),
    ],
)
def test_scale_to_zero_that_cannot_work_is_a_problem(fields: dict[str, Any], words: str) -> None:
    fields["scheduler"]["autoscaling"] = {
        k: v for k, v in fields["scheduler"]["autoscaling"].items() if v is not None
    }
    problems = validate(spec(**fields), None, "redis://r")
    assert any(words in p.message for p in problems), problems


def test_scale_to_zero_is_sound_with_a_hold_and_the_crd_says_the_rules() -> None:
    assert validate(spec(scheduler={"autoscaling": ZERO}, tokenizer=HOLD), None, "redis://r") == []
    root = crds.INFERENCE_SERVICE_SPEC
    (hold_rule,) = root["x-kubernetes-validations"]
    assert "holdTimeoutSeconds > 0" in hold_rule["rule"] and "minReplicas != 0" in hold_rule["rule"]
    auto = root["properties"]["scheduler"]["properties"]["autoscaling"]
    assert auto["properties"]["minReplicas"]["minimum"] == 0
    assert any("has(self.scaleToZeroAfter)" in r["rule"] for r in auto["x-kubernetes-validations"])
    # The deprecated field keeps its floor of one.
    assert root["properties"]["autoscaling"]["properties"]["minReplicas"]["minimum"] == 1
    # The gateway gets the hold settings.
    gateway = gateway_deployment(_zero_ctx(1))
    env = {e["name"]: e.get("value") for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RADIXSERVE_HOLD_TIMEOUT"] == "120" and env["RADIXSERVE_MAX_HELD_REQUESTS"] == "64"
    assert scheduler_statefulset(_zero_ctx(0))["spec"]["replicas"] == 0
