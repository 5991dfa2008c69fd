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
from typing import Any

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
from radixserve.operator.scaling import (
    LoadSource,
    RedisLoadSource,
    ScalePolicy,
    Stabilizer,
    recommend,
    total_waiting,
)

Obj = dict[str, Any]
ISVC = (GROUP, VERSION, "inferenceservices")
POOL = (GROUP, VERSION, "gpunodepools")
CONFIG = OperatorConfig.from_env()  # read at import: timer intervals are fixed when handlers register
SCHEDULER_PODS = f"app.kubernetes.io/component=scheduler,app.kubernetes.io/managed-by={manifests.MANAGED_BY}"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
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


def _isvc_spec(spec: Mapping[str, Any]) -> Obj:
    """The defaulted spec (apply_defaults descends only into plain dicts, so not kopf's Spec view)."""
    return apply_defaults(INFERENCE_SERVICE_SPEC, dict(spec))


def _pool_spec(spec: Mapping[str, Any]) -> Obj:
    return apply_defaults(GPU_NODE_POOL_SPEC, dict(spec))


def _cached(factory: Callable[[str], LoadSource]) -> Callable[[str], LoadSource]:
    sources: dict[str, LoadSource] = {}
    return lambda url: sources.get(url) or sources.setdefault(url, factory(url))


# ------------------------------------------------------------------------------------ indexes
@kopf.index(*POOL)
def pools(name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, **_: Any) -> Obj | None:
    if meta.get("deletionTimestamp"):
        return None  # a pool on its way out claims no more nodes
    return {name: {"spec": _pool_spec(spec), "status": dict(status)}}


@kopf.index(*ISVC)
def gpu_claims(
    namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> Obj | None:
    """pool -> (namespace/name, GPUs its schedulers hold), for judging what a pool has left."""
    try:
        s = _isvc_spec(spec)
        pool = s["scheduler"].get("nodePool")
        gpus = _scheduler_replicas(s, dict(status)) * int(s["scheduler"]["gpusPerReplica"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # a malformed spec claims nothing; reconcile reports it
    return {pool: (f"{namespace}/{name}", gpus)} if pool else None


def _one(index: kopf.Index[str, Obj], key: str | None) -> Obj | None:
    return next(iter(index.get(key, [])), None) if key else None


# ----------------------------------------------------------------------------- InferenceService
def _scheduler_replicas(spec: Obj, st: Obj) -> int:
    """The scheduler count in force: the autoscaler's last decision (within bounds) or the spec's."""
    auto = spec["autoscaling"]
    if not auto["enabled"]:
        return int(spec["scheduler"]["replicas"])
    desired = (st.get("autoscaling") or {}).get("desiredReplicas") or spec["scheduler"]["replicas"]
    return ScalePolicy.from_spec(auto).clamp(int(desired))


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
    ctx: manifests.BuildContext, kube: Kube, memo: kopf.Memo, patch: kopf.Patch, status_: Obj, logger: Any
) -> int:
    """The scheduler count after one look at the load (unchanged when there is none to see)."""
    policy = ScalePolicy.from_spec(ctx.spec["autoscaling"])
    current = ctx.scheduler_replicas
    try:
        url = _redis_url(kube, ctx.namespace, ctx.spec)
        loads = memo.load_source(url).loads(_scheduler_domain(ctx.name, ctx.namespace)) if url else {}
    except Exception as e:  # Redis down must not stop reconciling; we just do not scale this round
        logger.warning(f"autoscaling: cannot read scheduler load: {e}")
        return current
    rec = recommend(loads, policy)
    if rec is None:
        return current
    stabilizer = memo.setdefault("stabilizer", Stabilizer())
    new = stabilizer.decide(current, rec, time.monotonic(), policy)
    waiting = total_waiting(loads)
    last = (status_.get("autoscaling") or {}).get("lastScaleTime")
    if new != current:
        logger.info(f"autoscaling schedulers {current} -> {new} ({waiting} waiting over {len(loads)} pods)")
        last = status.now_iso()
    decision = {"desiredReplicas": new, "waiting": waiting, **({"lastScaleTime": last} if last else {})}
    _write_status(patch, status_, {"autoscaling": decision})
    return new


def reconcile(
    name: str,
    namespace: str,
    body: kopf.Body,
    spec: kopf.Spec,
    status_: Obj,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: Any,
    pools: kopf.Index[str, Obj],
    gpu_claims: kopf.Index[str, tuple[str, int]],
    autoscale: bool = False,
) -> None:
    kube: Kube = memo.kube
    generation = int(body.get("metadata", {}).get("generation") or 1)
    previous = status_.get("conditions")
    # The API server's schema validation catches most of this first; a spec that reached us anyway
    # (an older CRD, unknown fields pruned without strict validation, an emulator) is checked here,
    # and becomes a condition, never a crash loop.
    schema = schema_problems(INFERENCE_SERVICE_SPEC, dict(spec))
    try:
        if schema:
            raise ValueError("; ".join(schema[:5]))
        s = _isvc_spec(spec)
        pool_name = s["scheduler"].get("nodePool")
        pool = _one(pools, pool_name)
        problems = validation.validate(s, pool["spec"] if pool else None, CONFIG.chart_redis_url)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        why = str(e) if schema else repr(e)
        problems = [validation.Problem("InvalidSpec", f"spec does not match the schema: {why}")]
    if problems:
        logger.warning("invalid spec: " + "; ".join(p.message for p in problems))
        conditions = status.service_conditions(problems, None, {}, {}, generation, previous)
        _write_status(patch, status_, {"conditions": conditions, "observedGeneration": generation})
        return

    ctx = manifests.BuildContext(
        name=name,
        namespace=namespace,
        spec=s,
        image=s.get("image") or CONFIG.default_image,
        scheduler_replicas=_scheduler_replicas(s, status_),
        chart_redis_url=CONFIG.chart_redis_url,
        pool=pool["spec"] if pool else None,
        pool_name=pool_name or "",
    )
    if autoscale and s["autoscaling"]["enabled"]:
        ctx = dataclasses.replace(ctx, scheduler_replicas=_autoscale(ctx, kube, memo, patch, status_, logger))

    try:
        for obj in manifests.build_all(ctx):
            kopf.append_owner_reference(obj, owner=body)
            kube.apply(obj)
    except KubeError as e:
        if e.status >= 500 or e.status in (404, 409, 429):
            raise kopf.TemporaryError(f"applying children: {e}", delay=10) from e
        # The API server rejected what the spec asked for (e.g. a malformed resource quantity).
        problem = validation.Problem("ApplyFailed", f"the API server rejected a child object: {e}")
        conditions = status.service_conditions([problem], None, {}, {}, generation, previous)
        _write_status(patch, status_, {"conditions": conditions})
        return

    ready, desired = _observe(kube, ctx)
    shortfall = None
    if pool is not None:
        others = sum(g for key, g in gpu_claims.get(pool_name, []) if key != f"{namespace}/{name}")
        needed = ctx.scheduler_replicas * s["scheduler"]["gpusPerReplica"]
        shortfall = validation.gpu_shortfall(needed, pool["status"], others)
        if shortfall:
            shortfall = f"GPUNodePool {pool_name!r}: {shortfall}"
    _write_status(
        patch,
        status_,
        {
            "observedGeneration": generation,
            "schedulerReplicas": ctx.scheduler_replicas,
            "readyReplicas": ready,
            "replicas": {c: f"{ready[c]}/{desired[c]}" for c in desired},
            "endpoint": manifests.endpoints(ctx),
            "conditions": status.service_conditions([], shortfall, ready, desired, generation, previous),
        },
    )


def _write_status(patch: kopf.Patch, current: Obj, new: Obj) -> None:
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


@kopf.on.create(*ISVC)
def isvc_created(**kw: Any) -> None:
    reconcile(**_reconcile_kwargs(kw))


@kopf.on.update(*ISVC)
def isvc_updated(**kw: Any) -> None:
    reconcile(**_reconcile_kwargs(kw))


@kopf.on.resume(*ISVC)
def isvc_resumed(**kw: Any) -> None:
    reconcile(**_reconcile_kwargs(kw))


@kopf.timer(*ISVC, interval=CONFIG.resync_interval_s, initial_delay=CONFIG.resync_interval_s)
def isvc_resync(**kw: Any) -> None:
    """Level-triggered upkeep: status from the children, autoscaling, a pool that appeared."""
    reconcile(autoscale=True, **_reconcile_kwargs(kw))


def _reconcile_kwargs(kw: Obj) -> Obj:
    keys = ("name", "namespace", "body", "spec", "patch", "memo", "logger", "pools", "gpu_claims")
    return {"status_": dict(kw["status"]), **{k: kw[k] for k in keys}}


@kopf.on.delete(*ISVC)
def isvc_deleted(
    name: str, namespace: str | None, spec: kopf.Spec, memo: kopf.Memo, logger: Any, **_: Any
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
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.on.update(*POOL)
def pool_updated(
    name: str, spec: kopf.Spec, old: Any, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any
) -> None:
    # A changed taint: take the old one off our nodes first (sync_pool only knows the new one).
    old_taint = _pool_spec((old or {}).get("spec") or {}).get("taint")
    if old_taint and old_taint != _pool_spec(spec).get("taint"):
        _release_nodes(memo.kube, name, old_taint, keep_label=True)
    sync_pool(name, spec, body, memo, patch)


@kopf.on.resume(*POOL)
def pool_resumed(
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.timer(*POOL, interval=CONFIG.pool_interval_s, initial_delay=CONFIG.pool_interval_s)
def pool_resync(
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.on.delete(*POOL)
def pool_deleted(name: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
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
def node_changed(type: str, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
    """A node joined or changed labels: label and taint it now rather than at the next resync."""
    if type == "DELETED" or getattr(memo, "kube", None) is None:
        return
    pools: kopf.Index[str, Obj] = kw["pools"]
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
