"""Checks that a schema-valid InferenceService spec also makes sense: pure, so tests call it directly.

The CRD schema catches types and ranges; what it cannot express (one of two fields, a field that
contradicts another, a pool that must exist) lands here, and each finding becomes a ``Degraded``
condition with the reason and message below instead of an exception.
"""

from __future__ import annotations

from typing import NamedTuple

from radixserve.operator import tls, volumes
from radixserve.operator.manifests import Obj


class Problem(NamedTuple):
    reason: str  # CamelCase, the condition's reason
    message: str


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

    bad_tls = tls.problems(spec)
    problems += [Problem("InvalidSpec", message) for message in bad_tls]

    auto = spec["autoscaling"]
    if auto["enabled"]:
        if auto["minReplicas"] > auto["maxReplicas"]:
            bad(Problem("InvalidSpec", "autoscaling.minReplicas is greater than autoscaling.maxReplicas"))
        if auto["minReplicas"] < 1:
            bad(
                Problem(
                    "InvalidSpec",
                    "autoscaling.minReplicas must be at least 1 (the gateway needs a scheduler)",
                )
            )
        if redis["mode"] == "none":
            bad(
                Problem(
                    "InvalidSpec", "autoscaling reads scheduler load from Redis: redis.mode must not be none"
                )
            )
    elif sched["replicas"] < 1:
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
