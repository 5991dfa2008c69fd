"""Scheduler autoscaling: who scales (:func:`autoscaling`), where load comes from, what it asks for,
and how fast we follow.

    spec.scheduler.autoscaling.mode
      off        the StatefulSet follows spec.scheduler.replicas, which a person, an HPA or KEDA may
                 set (through the InferenceService's scale subresource)
      operator   the built-in autoscaler below sets it from the schedulers' load
      external   something else (an HPA, KEDA) scales the StatefulSet itself: the operator never
                 writes its replicas and reports the count it finds
    spec.autoscaling.enabled: true (deprecated; only when spec.scheduler.autoscaling.mode is unset)
                 is mode operator with spec.autoscaling's settings

    LoadSource.loads()  ->  recommend()  ->  Stabilizer.decide()  ->  StatefulSet replicas

Scale to zero (mode operator, ``minReplicas: 0`` with ``scaleToZeroAfter``; the gateways hold
requests, ``tokenizer.holdTimeoutSeconds``): ``scaleToZeroAfter`` seconds with no request anywhere
(:func:`busy`) take the schedulers to 0; a gateway whose load report (``LoadSource.gateway_loads``)
holds requests brings them back to ``ScalePolicy.active_min`` (scheduler_scale.autoscale).

Scheduler pods publish their load (``waiting``, ``running``, KV use, ...) as expiring heartbeats
in the prefix index's Redis, keyed by their advertised address under the service's key prefix; the
operator reads them (as the service's own Redis user, where it has one) through
:class:`RedisLoadSource` (over ``radixserve.common.prefix_index.RedisPrefixIndex``, which owns the
key layout). Tests use :class:`StaticLoadSource`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.operator.objects import Obj

Load = Obj  # one scheduler's heartbeat, as it published it: waiting, running, KV use, ...


class LoadSource(Protocol):
    def loads(self, host_suffix: str) -> dict[str, Load]:
        """Live loads of the scheduler pods whose advertised host ends with ``host_suffix``."""
        ...

    def gateway_loads(self) -> dict[str, Load]:
        """Live load reports of the service's gateways (``held``: requests waiting for a scheduler,
        ``in_flight``), by gateway address."""
        ...


def _on_service(pod: str, host_suffix: str) -> bool:
    """Whether ``pod`` (an advertised HOST:PORT) is one of the schedulers under ``host_suffix``.

    One Redis may serve several InferenceServices; each service's schedulers share the
    headless Service's domain.
    """
    return pod.rsplit(":", 1)[0].endswith(host_suffix)


class RedisLoadSource:
    """``key_prefix``: the service's (every InferenceService has its own, redis_acl.key_prefix)."""

    def __init__(self, url: str, key_prefix: str) -> None:
        from radixserve.common.prefix_index import RedisPrefixIndex, gateway_reports

        self.index = RedisPrefixIndex(url, key_prefix, timeout_s=2.0)
        self.gateways = gateway_reports(url, key_prefix, timeout_s=2.0)

    def loads(self, host_suffix: str) -> dict[str, Load]:
        return {pod: load for pod, load in self.index.live_pods().items() if _on_service(pod, host_suffix)}

    def gateway_loads(self) -> dict[str, Load]:
        self.gateways.sweep()  # a gateway that crashed never withdrew its report: it expired
        return self.gateways.live_pods()  # under the service's own key prefix: its gateways only


@dataclass
class StaticLoadSource:
    """In-memory stand-in: tests set ``by_pod`` directly."""

    by_pod: dict[str, Load] = field(default_factory=dict)
    by_gateway: dict[str, Load] = field(default_factory=dict)

    def loads(self, host_suffix: str) -> dict[str, Load]:
        return {p: load for p, load in self.by_pod.items() if _on_service(p, host_suffix)}

    def gateway_loads(self) -> dict[str, Load]:
        return dict(self.by_gateway)


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    min_replicas: int
    max_replicas: int
    target_waiting: float  # waiting requests per scheduler we aim for
    up_window_s: float = 0.0
    down_window_s: float = 300.0
    # Scale to zero: seconds without a request (none waiting, running or held anywhere) after which
    # the schedulers go to 0; None: never below ``active_min``.
    zero_after_s: float | None = None

    @classmethod
    def from_spec(cls, auto: Obj) -> ScalePolicy:
        zero_after = auto.get("scaleToZeroAfter")
        return cls(
            min_replicas=int(auto["minReplicas"]),
            max_replicas=int(auto["maxReplicas"]),
            target_waiting=float(auto["targetWaitingPerReplica"]),
            up_window_s=float(auto["scaleUpStabilizationSeconds"]),
            down_window_s=float(auto["scaleDownStabilizationSeconds"]),
            zero_after_s=float(zero_after) if zero_after is not None else None,
        )

    @property
    def active_min(self) -> int:
        """The floor while requests come: minReplicas, and at least one (minReplicas 0 only says
        the service may go to zero when idle)."""
        return max(1, self.min_replicas)

    def clamp(self, n: int) -> int:
        return max(self.active_min, min(self.max_replicas, n))


MODES = ("off", "operator", "external")


@dataclass(frozen=True, slots=True)
class Autoscaling:
    """Who scales the schedulers, and the settings the built-in autoscaler reads in mode operator."""

    mode: str  # one of MODES
    settings: Obj  # minReplicas, maxReplicas, targetWaitingPerReplica, stabilization seconds
    field: str  # where they came from: "scheduler.autoscaling", or the deprecated "autoscaling"


def autoscaling(spec: Obj) -> Autoscaling:
    """The autoscaling in force for a defaulted spec: spec.scheduler.autoscaling's mode when set, else
    the deprecated spec.autoscaling (enabled: mode operator), else off."""
    new, old = spec["scheduler"]["autoscaling"], spec["autoscaling"]
    if new.get("mode"):
        return Autoscaling(new["mode"], new, "scheduler.autoscaling")
    if old["enabled"]:
        return Autoscaling("operator", old, "autoscaling")
    return Autoscaling("off", new, "scheduler.autoscaling")


def scheduler_replicas(spec: Obj, status: Obj) -> int:
    """The scheduler count in force for a defaulted InferenceService spec and its status: the
    autoscaler's last decision (within bounds), the count last found on the StatefulSet (external),
    or the spec's."""
    auto = autoscaling(spec)
    if auto.mode == "external":
        found = status.get("schedulerReplicas")
        return int(found if found is not None else spec["scheduler"]["replicas"])
    if auto.mode == "off":
        return int(spec["scheduler"]["replicas"])
    policy = ScalePolicy.from_spec(auto.settings)
    desired = (status.get("autoscaling") or {}).get("desiredReplicas")
    if desired == 0 and policy.zero_after_s is not None:  # scaled to zero: it stays there until load
        return 0
    return policy.clamp(int(desired or spec["scheduler"]["replicas"]))


def total_waiting(loads: dict[str, Load]) -> int:
    return sum(int(load.get("waiting", 0)) for load in loads.values())


def total_held(gateways: dict[str, Load]) -> int:
    """Requests the gateways hold for want of a scheduler: the signal that scales from zero."""
    return sum(int(load.get("held", 0) or 0) for load in gateways.values())


def busy(loads: dict[str, Load], gateways: dict[str, Load]) -> bool:
    """Whether any request is anywhere: waiting or running on a scheduler, held or in flight at a
    gateway (the idle clock of scale to zero restarts)."""
    on_schedulers = any(int(x.get("waiting", 0) or 0) + int(x.get("running", 0) or 0) for x in loads.values())
    at_gateways = any(int(x.get("held", 0) or 0) + int(x.get("in_flight", 0) or 0) for x in gateways.values())
    return on_schedulers or at_gateways


def recommend(loads: dict[str, Load], policy: ScalePolicy) -> int | None:
    """Replicas that would bring waiting requests per scheduler to the target; None without data."""
    if not loads:
        return None
    return policy.clamp(math.ceil(total_waiting(loads) / policy.target_waiting))


@dataclass
class Stabilizer:
    """Follows recommendations, but only as far as every one in the window agrees (as the HPA does).

    Scale up to the lowest recommendation of the last ``up_window_s`` (a spike must last), scale
    down to the highest of the last ``down_window_s`` (a lull must last). Its history lives in
    memory: after an operator restart nothing scales down until a whole window has been seen.
    """

    history: deque[tuple[float, int]] = field(default_factory=deque)
    first_seen: float | None = None
    busy_at: float | None = None  # when a request was last seen anywhere (scale to zero's idle clock)

    def idle_for(self, busy: bool, now: float) -> float:
        """Seconds without a request, counted from the first look after an operator (re)start: it
        cannot know what came before, so it waits a whole idle period before scaling to zero."""
        if busy or self.busy_at is None:
            self.busy_at = now
        return now - self.busy_at

    def decide(self, current: int, rec: int, now: float, policy: ScalePolicy) -> int:
        if self.first_seen is None:
            self.first_seen = now
        self.history.append((now, rec))
        horizon = max(policy.up_window_s, policy.down_window_s)
        while self.history and now - self.history[0][0] > horizon:
            self.history.popleft()
        if rec > current:
            up = min(r for t, r in self.history if now - t <= policy.up_window_s)
            return policy.clamp(max(current, up))
        if rec < current:
            if now - self.first_seen < policy.down_window_s:
                return policy.clamp(current)
            down = max(r for t, r in self.history if now - t <= policy.down_window_s)
            return policy.clamp(min(current, down))
        return policy.clamp(current)
