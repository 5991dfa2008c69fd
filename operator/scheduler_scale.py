"""How many schedulers an InferenceService runs this round, by its autoscaling mode (scaling.autoscaling):

    off        spec.scheduler.replicas (a person, or an HPA/KEDA through the scale subresource)
    operator   the built-in autoscaler: the schedulers' load -> recommend -> a per-service Stabilizer
    external   whatever the NAME-scheduler StatefulSet has: an HPA or KEDA owns its replicas

External mode and server-side apply: the operator applies the StatefulSet without ``replicas``, and
an apply that leaves out a field the same manager applied before *removes* it (the StatefulSet would
fall back to 1 replica) unless another manager owns it too. A service that switches to external mode
has applied replicas before, so first the operator's claim on the field is dropped from the
StatefulSet's managedFields (:func:`replicas_release`): the count stays as it is, owned by nobody
until the HPA's first scale takes it.
"""

from __future__ import annotations

import copy
import time

from radixserve.operator import manifests, status
from radixserve.operator.kube import FIELD_MANAGER, Kube
from radixserve.operator.objects import Obj
from radixserve.operator.scaling import (
    LoadSource,
    ScalePolicy,
    Stabilizer,
    autoscaling,
    busy,
    recommend,
    total_held,
    total_waiting,
)

DEFAULT_STATEFULSET_REPLICAS = 1  # what the API server gives a StatefulSet applied without replicas


def scheduler_domain(name: str, namespace: str) -> str:
    """The host suffix every scheduler of InferenceService ``name`` advertises (see manifests)."""
    return f".{name}-scheduler.{namespace}.svc"


def replicas_release(live: Obj, manager: str = FIELD_MANAGER) -> Obj | None:
    """A merge patch taking ``spec.replicas`` out of ``manager``'s server-side-apply claim on the
    ``live`` object (its managedFields), so that applying without the field leaves the count alone;
    None when ``manager`` does not claim it. The patch carries the resourceVersion it was made from: a
    write in between makes it fail (409) rather than drop another manager's claim."""
    meta = live.get("metadata") or {}
    entries = copy.deepcopy(meta.get("managedFields") or [])
    released = False
    for entry in entries:
        spec_fields = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if (
            entry.get("manager") == manager
            and entry.get("operation") == "Apply"
            and "f:replicas" in spec_fields
        ):
            del spec_fields["f:replicas"]
            released = True
    if not released:
        return None
    return {"metadata": {"managedFields": entries, "resourceVersion": meta.get("resourceVersion")}}


def external_replicas(kube: Kube, ctx: manifests.BuildContext) -> int:
    """Mode external: the StatefulSet's own count (the API server's default before it exists), after
    dropping the operator's claim on it where an earlier mode left one."""
    name = manifests.child_name(ctx, "scheduler")
    live = kube.get("StatefulSet", ctx.namespace, name)
    if live is None:
        return DEFAULT_STATEFULSET_REPLICAS
    release = replicas_release(live)
    if release is not None:
        kube.merge_patch("StatefulSet", ctx.namespace, name, release)
    return int((live.get("spec") or {}).get("replicas", DEFAULT_STATEFULSET_REPLICAS))


def autoscale(
    ctx: manifests.BuildContext,
    source: LoadSource | None,
    stabilizer: Stabilizer,
    current: Obj,
    now: float | None = None,
) -> tuple[int, Obj, str]:
    """Mode operator, one look at the load: (the scheduler count, status.autoscaling, a log line or
    ""). Without load to see (no source, no heartbeats) the count stays, but for scale to zero:

    * at 0, a gateway that holds a request brings the schedulers to ``active_min`` at once (no
      stabilization window: every held second is a client waiting);
    * with ``scaleToZeroAfter``, that many seconds without any request (none waiting or running on
      a scheduler, none held or in flight at a gateway) take them to 0. Each scheduler drains at its
      SIGTERM (finishes what it runs, admits nothing); a request that comes meanwhile is held at the
      gateway, and its held count brings the schedulers back.
    """
    now = time.monotonic() if now is None else now
    policy = ScalePolicy.from_spec(autoscaling(ctx.spec).settings)
    replicas = ctx.scheduler_replicas
    loads = source.loads(scheduler_domain(ctx.name, ctx.namespace)) if source else {}
    gateways = source.gateway_loads() if source else {}
    held = total_held(gateways)
    idle_s = stabilizer.idle_for(busy(loads, gateways), now)
    previous = current.get("autoscaling") or {}
    if replicas == 0:
        new = policy.active_min if held else 0
        why = f"{held} requests held at the gateways"
    elif policy.zero_after_s is not None and idle_s >= policy.zero_after_s:
        new, why = 0, f"no requests for {idle_s:.0f} s (scaleToZeroAfter {policy.zero_after_s:g})"
    else:
        rec = recommend(loads, policy)
        if rec is None:
            return replicas, previous, ""
        new = stabilizer.decide(replicas, rec, now, policy)
        why = f"{total_waiting(loads)} waiting over {len(loads)} pods"
    last = previous.get("lastScaleTime")
    said = ""
    if new != replicas:
        said = f"autoscaling schedulers {replicas} -> {new} ({why})"
        last = status.now_iso()
    decision = {
        "desiredReplicas": new,
        "waiting": total_waiting(loads),
        "held": held,
        **({"lastScaleTime": last} if last else {}),
    }
    return new, decision, said
