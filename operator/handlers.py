"""kopf handlers: thin glue between events and the pure modules.

Every InferenceService event (create, update, resume, the resync timer) runs the same idempotent
:func:`reconcile`: validate, maybe autoscale, apply the children, write status. Nothing here
raises on bad input: a spec problem becomes a ``Degraded`` condition; only API trouble (5xx,
conflicts) raises ``kopf.TemporaryError`` for kopf to retry with a delay.

Runtime dependencies arrive through kopf's ``memo`` (see ``__main__``): ``memo.kube`` (a
:class:`Kube`), ``memo.load_source`` (URL -> :class:`LoadSource`).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypedDict, cast

import kopf

from radixserve.operator import manifests, nodepool, status, validation
from radixserve.operator.config import OperatorConfig
from radixserve.operator.crds import (
    GPU_NODE_POOL_SPEC,
    GROUP,
    INFERENCE_SERVICE_SPEC,
    VERSION,
    apply_defaults,
    schema_problems,
)
from radixserve.operator.kube import Kube, KubeError, load_config
from radixserve.operator.manifests import Obj
from radixserve.operator.scaling import (
    LoadSource,
    RedisLoadSource,
    ScalePolicy,
    Stabilizer,
    recommend,
    scheduler_replicas,
    total_waiting,
)

ISVC = (GROUP, VERSION, "inferenceservices")
POOL = (GROUP, VERSION, "gpunodepools")
CONFIG = OperatorConfig.from_env()  # read at import: timer intervals are fixed when handlers register
SCHEDULER_PODS = f"app.kubernetes.io/component=scheduler,app.kubernetes.io/managed-by={manifests.MANAGED_BY}"
RESYNC = "resync"  # the param kopf hands reconcile when the resync timer calls it


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: object) -> None:
    # Progress and the last-handled spec live in annotations, so status holds only our fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.posting.level = logging.WARNING
    if getattr(memo, "kube", None) is None:
        load_config()
        memo.kube = Kube()
    if getattr(memo, "load_source", None) is None:
        memo.load_source = _cached(RedisLoadSource)


def _isvc_spec(spec: Mapping[str, object]) -> Obj:
    """The defaulted spec (apply_defaults descends only into plain dicts, so not kopf's Spec view)."""
    return apply_defaults(INFERENCE_SERVICE_SPEC, dict(spec))


def _pool_spec(spec: Mapping[str, object]) -> Obj:
    return apply_defaults(GPU_NODE_POOL_SPEC, dict(spec))


def _cached(factory: Callable[[str], LoadSource]) -> Callable[[str], LoadSource]:
    sources: dict[str, LoadSource] = {}
    return lambda url: sources.get(url) or sources.setdefault(url, factory(url))


# ------------------------------------------------------------------------------------ indexes
class PoolEntry(TypedDict):
    """The ``pools`` index's value for a GPUNodePool (keyed by its name)."""

    spec: Obj  # defaulted
    status: Obj


class GpuClaim(NamedTuple):
    """The ``gpu_claims`` index's value: GPUs one InferenceService's schedulers hold in a pool."""

    service: str  # namespace/name
    gpus: int


PoolIndex = kopf.Index[str, PoolEntry]
GpuClaimIndex = kopf.Index[str, GpuClaim]  # keyed by pool name


@kopf.index(*POOL)
def pools(
    name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, **_: object
) -> dict[str, PoolEntry] | None:
    if meta.get("deletionTimestamp"):
        return None  # a pool on its way out claims no more nodes
    return {name: {"spec": _pool_spec(spec), "status": dict(status)}}


@kopf.index(*ISVC)
def gpu_claims(
    namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, **_: object
) -> dict[str, GpuClaim] | None:
    """pool -> the GPUs this InferenceService's schedulers hold, for judging what a pool has left."""
    try:
        s = _isvc_spec(spec)
        pool = s["scheduler"].get("nodePool")
        gpus = scheduler_replicas(s, dict(status)) * int(s["scheduler"]["gpusPerReplica"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # a malformed spec claims nothing; reconcile reports it
    return {pool: GpuClaim(f"{namespace}/{name}", gpus)} if pool else None


def _indexes(handler_kwargs: Mapping[str, object]) -> tuple[PoolIndex, GpuClaimIndex]:
    """The two indexes among a handler's other keyword arguments (kopf passes them by name)."""
    return cast(PoolIndex, handler_kwargs["pools"]), cast(GpuClaimIndex, handler_kwargs["gpu_claims"])


def _pool_entry(pools: PoolIndex, pool_name: str | None) -> PoolEntry | None:
    return next(iter(pools.get(pool_name, [])), None) if pool_name else None


# ----------------------------------------------------------------------------- InferenceService
def _redis_url(kube: Kube, namespace: str, spec: Obj) -> str | None:
    redis = spec["redis"]
    if redis["mode"] == "chart":
        return CONFIG.chart_redis_url
    if redis["mode"] == "external":
        ref = redis["urlSecretRef"]
        secret = kube.get("Secret", namespace, ref["name"]) or {}
        raw = (secret.get("data") or {}).get(ref.get("key") or "url")
        return base64.b64decode(raw).decode() if raw else None
    return None


def _scheduler_domain(name: str, namespace: str | None) -> str:
    """The host suffix every scheduler of InferenceService ``name`` advertises (see manifests)."""
    return f".{name}-scheduler.{namespace}.svc"


def _autoscale(
    ctx: manifests.BuildContext,
    kube: Kube,
    memo: kopf.Memo,
    patch: kopf.Patch,
    current: Obj,
    logger: kopf.Logger,
) -> int:
    """The scheduler count after one look at the load (unchanged when there is none to see)."""
    policy = ScalePolicy.from_spec(ctx.spec["autoscaling"])
    replicas = ctx.scheduler_replicas
    try:
        url = _redis_url(kube, ctx.namespace, ctx.spec)
        loads = memo.load_source(url).loads(_scheduler_domain(ctx.name, ctx.namespace)) if url else {}
    except Exception as e:  # Redis down must not stop reconciling; we just do not scale this round
        logger.warning(f"autoscaling: cannot read scheduler load: {e}")
        return replicas
    rec = recommend(loads, policy)
    if rec is None:
        return replicas
    stabilizer: Stabilizer = memo.setdefault("stabilizer", Stabilizer())
    new = stabilizer.decide(replicas, rec, time.monotonic(), policy)
    waiting = total_waiting(loads)
    last = (current.get("autoscaling") or {}).get("lastScaleTime")
    if new != replicas:
        logger.info(f"autoscaling schedulers {replicas} -> {new} ({waiting} waiting over {len(loads)} pods)")
        last = status.now_iso()
    decision = {"desiredReplicas": new, "waiting": waiting, **({"lastScaleTime": last} if last else {})}
    _write_status(patch, current, {"autoscaling": decision})
    return new


# Every InferenceService event runs reconcile (it is idempotent); the ids keep the handler names kopf
# has logged and annotated so far. Decorators apply bottom-up: the timer first (kopf's types take a
# timer function as a change handler, not the reverse), then create, update, resume, kopf's order.
@kopf.on.resume(*ISVC, id="isvc_resumed")
@kopf.on.update(*ISVC, id="isvc_updated")
@kopf.on.create(*ISVC, id="isvc_created")
@kopf.timer(
    *ISVC,
    id="isvc_resync",
    interval=CONFIG.resync_interval_s,
    initial_delay=CONFIG.resync_interval_s,
    param=RESYNC,
)
def reconcile(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: kopf.Logger,
    param: object = None,
    **kw: object,
) -> None:
    """Validate, maybe autoscale, apply the children, write status.

    The resync timer (``param`` is :data:`RESYNC`) is the level-triggered upkeep: status from the
    children, autoscaling, a pool that appeared; it alone autoscales.
    """
    assert namespace is not None, "InferenceServices are namespaced"
    kube: Kube = memo.kube
    pools, gpu_claims = _indexes(kw)
    current = dict(status)
    generation = int(body.get("metadata", {}).get("generation") or 1)
    defaulted, pool, problems = _checked_spec(spec, pools)
    if problems:
        logger.warning("invalid spec: " + "; ".join(p.message for p in problems))
        _write_degraded(patch, current, problems, generation, observedGeneration=generation)
        return

    ctx = _build_context(name, namespace, defaulted, pool, current)
    if param == RESYNC and defaulted["autoscaling"]["enabled"]:
        ctx = dataclasses.replace(ctx, scheduler_replicas=_autoscale(ctx, kube, memo, patch, current, logger))
    rejected = _apply_children(kube, body, ctx)
    if rejected is not None:
        _write_degraded(patch, current, [rejected], generation)
        return
    _write_observed(patch, current, kube, ctx, _pool_shortfall(ctx, pool, gpu_claims), generation)


def _checked_spec(
    spec: kopf.Spec, pools: PoolIndex
) -> tuple[Obj, PoolEntry | None, list[validation.Problem]]:
    """The defaulted spec, its GPUNodePool's index entry, and the problems (then the spec is {}).

    The API server's schema validation catches most of this first; a spec that reached us anyway
    (an older CRD, unknown fields pruned without strict validation, an emulator) is checked here,
    and becomes a condition, never a crash loop.
    """
    schema = schema_problems(INFERENCE_SERVICE_SPEC, dict(spec))
    if schema:
        why = "; ".join(schema[:5])
        return {}, None, [validation.Problem("InvalidSpec", f"spec does not match the schema: {why}")]
    try:
        defaulted = _isvc_spec(spec)
        pool = _pool_entry(pools, defaulted["scheduler"].get("nodePool"))
        pool_spec = pool["spec"] if pool else None
        return defaulted, pool, validation.validate(defaulted, pool_spec, CONFIG.chart_redis_url)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return {}, None, [validation.Problem("InvalidSpec", f"spec does not match the schema: {e!r}")]


def _build_context(
    name: str, namespace: str, spec: Obj, pool: PoolEntry | None, current: Obj
) -> manifests.BuildContext:
    return manifests.BuildContext(
        name=name,
        namespace=namespace,
        spec=spec,
        image=spec.get("image") or CONFIG.default_image,
        scheduler_replicas=scheduler_replicas(spec, current),
        chart_redis_url=CONFIG.chart_redis_url,
        pool=pool["spec"] if pool else None,
        pool_name=spec["scheduler"].get("nodePool") or "",
    )


def _apply_children(kube: Kube, owner: kopf.Body, ctx: manifests.BuildContext) -> validation.Problem | None:
    """Apply every child: the problem when the API server rejects one; API trouble raises (kopf retries)."""
    try:
        for obj in manifests.build_all(ctx):
            kopf.append_owner_reference(obj, owner=owner)
            kube.apply(obj)
    except KubeError as e:
        if e.status >= 500 or e.status in (404, 409, 429):
            raise kopf.TemporaryError(f"applying children: {e}", delay=10) from e
        # The API server rejected what the spec asked for (e.g. a malformed resource quantity).
        return validation.Problem("ApplyFailed", f"the API server rejected a child object: {e}")
    return None


def _pool_shortfall(
    ctx: manifests.BuildContext, pool: PoolEntry | None, gpu_claims: GpuClaimIndex
) -> str | None:
    """Why the GPUNodePool cannot hold our schedulers beside the other services' (None: it can)."""
    if pool is None:
        return None
    service = f"{ctx.namespace}/{ctx.name}"
    others = sum(claim.gpus for claim in gpu_claims.get(ctx.pool_name, []) if claim.service != service)
    needed = ctx.scheduler_replicas * ctx.spec["scheduler"]["gpusPerReplica"]
    shortfall = validation.gpu_shortfall(needed, pool["status"], others)
    return f"GPUNodePool {ctx.pool_name!r}: {shortfall}" if shortfall else None


def _write_degraded(
    patch: kopf.Patch, current: Obj, problems: list[validation.Problem], generation: int, **fields: object
) -> None:
    """Conditions for a round that stopped at ``problems`` (and any other status ``fields``)."""
    previous = current.get("conditions")
    conditions = status.service_conditions(problems, None, {}, {}, generation, previous)
    _write_status(patch, current, {"conditions": conditions, **fields})


def _write_observed(
    patch: kopf.Patch,
    current: Obj,
    kube: Kube,
    ctx: manifests.BuildContext,
    shortfall: str | None,
    generation: int,
) -> None:
    """Status for a round that applied the children: their readiness, the endpoint, conditions."""
    ready, desired = _observe(kube, ctx)
    failure = status.scheduler_failure(
        kube.list("Pod", ctx.namespace, labels=manifests.selector(ctx, "scheduler"))
    )
    previous = current.get("conditions")
    _write_status(
        patch,
        current,
        {
            "observedGeneration": generation,
            "schedulerReplicas": ctx.scheduler_replicas,
            "readyReplicas": ready,
            "replicas": {c: f"{ready[c]}/{desired[c]}" for c in desired},
            "endpoint": manifests.endpoints(ctx),
            "conditions": status.service_conditions(
                [], shortfall, ready, desired, generation, previous, failure=failure
            ),
        },
    )


def _write_status(patch: kopf.Patch, current: Obj, new: Mapping[str, object]) -> None:
    """Patch only what changed: the resync timer then writes nothing to a settled object."""
    for key, value in new.items():
        if current.get(key) != value:
            patch.status[key] = value


def _observe(kube: Kube, ctx: manifests.BuildContext) -> tuple[dict[str, int], dict[str, int]]:
    """Ready and desired replicas per component; a pod counts once it runs the current template."""
    desired = {
        "gateway": ctx.spec["tokenizer"]["replicas"],
        "scheduler": ctx.scheduler_replicas,
        "detokenizer": ctx.spec["detokenizer"]["replicas"],
    }
    kinds = {"gateway": "Deployment", "scheduler": "StatefulSet", "detokenizer": "Deployment"}
    ready = {}
    for component, kind in kinds.items():
        obj = kube.get(kind, ctx.namespace, manifests.child_name(ctx, component)) or {}
        st = obj.get("status") or {}
        n = int(st.get("readyReplicas") or 0)
        ready[component] = min(n, int(st.get("updatedReplicas", n) or 0))
    return ready, desired


@kopf.on.delete(*ISVC)
def isvc_deleted(
    name: str, namespace: str | None, spec: kopf.Spec, memo: kopf.Memo, logger: kopf.Logger, **_: object
) -> None:
    """Children go by owner references; here we only drop the schedulers' entries from the
    chart's Redis (best effort: a Redis that is down must not hold the deletion)."""
    s = _isvc_spec(spec)
    if s["redis"]["mode"] != "chart" or not CONFIG.chart_redis_url:
        return
    try:
        source = RedisLoadSource(CONFIG.chart_redis_url)
        for pod in source.loads(_scheduler_domain(name, namespace)):
            source.index.remove_pod(pod)
    except Exception as e:
        logger.warning(f"could not clean the prefix index of {name}: {e}")


# ---------------------------------------------------------------------------------- GPUNodePool
def sync_pool(name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch) -> None:
    """Label and taint the matching nodes, release the ones that stopped matching, count GPUs."""
    kube: Kube = memo.kube
    s = _pool_spec(spec)
    selector = s.get("nodeSelector") or {}
    taint = s.get("taint")
    members = []
    # Candidates: the nodes the selector matches and the nodes we labelled before (they may have
    # stopped matching). Selectors go to the server and are checked here too (an emulator or a
    # proxy may ignore them); an empty selector matches nothing rather than every node.
    candidates = {n["metadata"]["name"]: n for n in kube.list("Node", None, f"{manifests.POOL_LABEL}={name}")}
    if selector:
        match = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        candidates.update({n["metadata"]["name"]: n for n in kube.list("Node", None, match)})
    for node_name, node in sorted(candidates.items()):
        if nodepool.node_matches(node, selector):
            members.append(node)
            change = nodepool.join_patch(node, name, taint)
        else:
            change = nodepool.leave_patch(node, name, taint)
        if change:
            kube.merge_patch("Node", None, node_name, change)
    requested = 0
    for pod in kube.list("Pod", None, SCHEDULER_PODS):
        if (pod.get("spec", {}).get("nodeSelector") or {}).get(manifests.POOL_LABEL) == name:
            requested += nodepool.pod_gpus(pod, s["gpuResourceName"])
    st = nodepool.pool_status(members, s["gpuResourceName"], requested)
    generation = int(body.get("metadata", {}).get("generation") or 1)
    previous = body.get("status", {}).get("conditions")
    has_nodes = st["nodes"] > 0
    message = (
        f"{st['nodes']} nodes, {st['gpus']['allocatable']} GPUs allocatable"
        if has_nodes
        else f"no node matches {selector}"
    )
    st["conditions"] = [
        status.condition(
            "Ready",
            has_nodes,
            "NodesFound" if has_nodes else "NoMatchingNodes",
            message,
            generation,
            previous,
            status.now_iso(),
        )
    ]
    st["observedGeneration"] = generation
    _write_status(patch, dict(body.get("status") or {}), st)


@kopf.on.create(*POOL)
def pool_created(
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: object
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.on.update(*POOL)
def pool_updated(
    name: str,
    spec: kopf.Spec,
    old: kopf.BodyEssence | None,
    body: kopf.Body,
    memo: kopf.Memo,
    patch: kopf.Patch,
    **_: object,
) -> None:
    # A changed taint: take the old one off our nodes first (sync_pool only knows the new one).
    old_taint = _pool_spec((old or {}).get("spec") or {}).get("taint")
    if old_taint and old_taint != _pool_spec(spec).get("taint"):
        _release_nodes(memo.kube, name, old_taint, keep_label=True)
    sync_pool(name, spec, body, memo, patch)


@kopf.on.resume(*POOL)
def pool_resumed(
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: object
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.timer(*POOL, interval=CONFIG.pool_interval_s, initial_delay=CONFIG.pool_interval_s)
def pool_resync(
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: object
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.on.delete(*POOL)
def pool_deleted(name: str, spec: kopf.Spec, memo: kopf.Memo, **_: object) -> None:
    """Give the nodes back: drop our label and taint."""
    _release_nodes(memo.kube, name, _pool_spec(spec).get("taint"))


def _release_nodes(kube: Kube, pool: str, taint: Obj | None, keep_label: bool = False) -> None:
    for node in kube.list("Node", None, f"{manifests.POOL_LABEL}={pool}"):
        change = nodepool.leave_patch(node, pool, taint)
        if change and keep_label:
            change.pop("metadata", None)
        if change:
            kube.merge_patch("Node", None, node["metadata"]["name"], change)


@kopf.on.event("v1", "nodes")
def node_changed(type: str, body: kopf.Body, memo: kopf.Memo, **kw: object) -> None:
    """A node joined or changed labels: label and taint it now rather than at the next resync."""
    if type == "DELETED" or getattr(memo, "kube", None) is None:
        return
    pools, _ = _indexes(kw)
    node = dict(body)
    for pool_name, store in pools.items():
        for pool in store:
            if not nodepool.node_matches(node, pool["spec"].get("nodeSelector") or {}):
                continue
            change = nodepool.join_patch(node, pool_name, pool["spec"].get("taint"))
            # The index can lag a pool's deletion by an event: ask the API before claiming.
            live = memo.kube.get("GPUNodePool", None, pool_name) if change else None
            if live and not live["metadata"].get("deletionTimestamp"):
                memo.kube.merge_patch("Node", None, node["metadata"]["name"], change)
                return
