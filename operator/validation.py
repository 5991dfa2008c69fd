"""Checks that a schema-valid InferenceService spec also makes sense: pure, so tests call it directly.

The CRD schema catches types and ranges; what it cannot express (one of two fields, a field that
contradicts another, a pool that must exist) lands here, and each finding becomes a ``Degraded``
condition with the reason and message below instead of an exception.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from radixserve.operator import kv_cache, nodepool, scaling, tls, volumes
from radixserve.operator.manifests import MAX_NAME_LENGTH
from radixserve.operator.objects import Obj

# The children's names start with the InferenceService's (NAME-gateway, ...): Services need DNS-1035
# labels, and the scheduler pods' controller-revision-hash label caps the length (manifests). The
# CRD's CEL rules say the same (crds.py); servers without CEL, and emulators, leave it to us.
NAME_FORMAT = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_FORMAT_MESSAGE = (
    "metadata.name must start with a letter and hold only lower-case letters, digits and '-': the "
    "Services NAME-gateway, NAME-scheduler and NAME-detokenizer are named after it"
)
NAME_LENGTH_MESSAGE = (
    f"metadata.name must be at most {MAX_NAME_LENGTH} characters: the scheduler pods carry the label "
    "controller-revision-hash: NAME-scheduler-<10 characters>, and a label value holds at most 63"
)


class Problem(NamedTuple):
    reason: str  # CamelCase, the condition's reason
    message: str


def name_problems(name: str) -> list[Problem]:
    """What is wrong with an InferenceService's name (the CRD's CEL rules, for servers without CEL)."""
    problems = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(Problem("InvalidName", NAME_LENGTH_MESSAGE))
    if not re.fullmatch(NAME_FORMAT, name):
        problems.append(Problem("InvalidName", NAME_FORMAT_MESSAGE))
    return problems


def validate(spec: Obj, pool: Obj | None, chart_redis_url: str) -> list[Problem]:
    """``spec`` is defaulted (crds.apply_defaults); ``pool`` is the named GPUNodePool or None."""
    problems: list[Problem] = []
    bad = problems.append

    problems += [Problem("InvalidModel", message) for message in volumes.model_problems(spec)]

    sched = spec["scheduler"]
    # Any count of GPUs above 1 is tensor parallelism over them. Whether the model's heads divide by
    # it only the scheduler can tell (the pod fetches the model): a scheduler that cannot split the
    # model exits saying why, and status.scheduler_failure makes that Degraded/SchedulerFailed.
    if sched["device"] == "cuda" and sched["gpusPerReplica"] < 1:
        bad(Problem("InvalidSpec", "scheduler.device is cuda but scheduler.gpusPerReplica is 0"))
    if sched["device"] == "cpu" and sched["gpusPerReplica"] > 0:
        bad(Problem("InvalidSpec", "scheduler.device is cpu but scheduler.gpusPerReplica asks for GPUs"))
    if sched.get("nodePool") and pool is None:
        bad(Problem("UnknownNodePool", f"GPUNodePool {sched['nodePool']!r} does not exist"))
    for message in nodepool.pool_problems(pool) if pool is not None else []:
        bad(Problem("InvalidNodePool", f"GPUNodePool {sched.get('nodePool')!r}: {message}"))

    redis = spec["redis"]
    if redis["mode"] == "external" and not (redis.get("urlSecretRef") or {}).get("name"):
        bad(Problem("InvalidSpec", "redis.mode is external but redis.urlSecretRef is not set"))
    if redis["mode"] == "chart" and not chart_redis_url:
        bad(
            Problem(
                "InvalidSpec", "redis.mode is chart but the chart's Redis is disabled; use external or none"
            )
        )
    if redis["mode"] == "none" and spec["tokenizer"]["replicas"] > 1:
        bad(
            Problem(
                "InvalidSpec",
                "redis.mode none keeps the prefix index in one gateway: tokenizer.replicas must be 1",
            )
        )

    problems += [Problem("InvalidSpec", message) for message in kv_cache.problems(spec)]

    bad_tls = tls.problems(spec)
    problems += [Problem("InvalidSpec", message) for message in bad_tls]

    problems += _autoscaling_problems(spec)
    return problems


def _autoscaling_problems(spec: Obj) -> list[Problem]:
    auto = scaling.autoscaling(spec)
    problems: list[Problem] = []
    bad = problems.append
    if spec["autoscaling"]["enabled"] and spec["scheduler"]["autoscaling"].get("mode"):
        bad(
            Problem(
                "InvalidSpec",
                "autoscaling (deprecated) and scheduler.autoscaling.mode are both set: remove autoscaling "
                "(its settings go in scheduler.autoscaling)",
            )
        )
    if auto.mode != "off" and spec["redis"]["mode"] == "none":
        why = "the autoscaler reads scheduler load and " if auto.mode == "operator" else ""
        bad(
            Problem(
                "InvalidSpec",
                f"{auto.field} mode {auto.mode}: {why}gateways discover the schedulers in Redis, so "
                "redis.mode must not be none",
            )
        )
    settings = auto.settings
    if auto.mode == "operator" and settings["minReplicas"] > settings["maxReplicas"]:
        bad(Problem("InvalidSpec", f"{auto.field}.minReplicas is greater than {auto.field}.maxReplicas"))
    zero_after = settings.get("scaleToZeroAfter")
    if auto.mode == "operator" and settings["minReplicas"] < 1 and zero_after is None:
        bad(
            Problem(
                "InvalidSpec",
                f"{auto.field}.minReplicas 0 needs scaleToZeroAfter (the seconds without requests before"
                " zero); without it the gateway needs a scheduler: set minReplicas to at least 1",
            )
        )
    if zero_after is not None and auto.mode != "operator":
        bad(
            Problem(
                "InvalidSpec",
                "scheduler.autoscaling.scaleToZeroAfter is the built-in autoscaler's: mode is"
                f" {auto.mode}, set it to operator (in mode external KEDA's ScaledObject scales to zero:"
                " docs/kubernetes.md)",
            )
        )
    holds = float(spec["tokenizer"].get("holdTimeoutSeconds") or 0) > 0
    if (zero_after is not None or (auto.mode == "operator" and settings["minReplicas"] < 1)) and not holds:
        bad(
            Problem(
                "InvalidSpec",
                "scheduler.autoscaling.minReplicas 0 and scaleToZeroAfter need tokenizer.holdTimeoutSeconds"
                " above 0: with no scheduler, a request must wait for one instead of failing at once",
            )
        )
    if auto.mode == "off" and spec["scheduler"]["replicas"] < 1:
        bad(Problem("InvalidSpec", "scheduler.replicas must be at least 1 (the gateway needs a scheduler)"))
    return problems


def gpu_shortfall(needed: int, pool_status: Obj | None, requested_by_others: int) -> str | None:
    """A message when the pool cannot hold ``needed`` more GPUs, else None.

    ``requested_by_others``: GPUs our other InferenceServices already hold in the pool. Before the
    pool's first status (no count yet) we do not judge.
    """
    gpus = (pool_status or {}).get("gpus")
    if needed == 0 or not gpus:
        return None
    allocatable = gpus.get("allocatable", 0)
    free = int(allocatable) - requested_by_others
    if needed <= free:
        return None
    return f"needs {needed} GPUs but the pool has {max(free, 0)} free of {allocatable} allocatable"
