"""kopf handlers for InferenceServices: thin glue between events and the pure modules.

Every InferenceService event (create, update, resume, the resync timer) runs the same idempotent
:func:`reconcile`: validate, set the service's Redis user, maybe autoscale, apply the children
(credentials Secret, NetworkPolicies, config, Services, workloads), write status. Nothing here
raises on bad input: a spec problem becomes a ``Degraded`` condition; only API trouble (5xx,
conflicts) raises ``kopf.TemporaryError`` for kopf to retry with a delay. A Redis that is down
never stops a reconcile (the next resync sets the user again). GPUNodePools: pool_handlers.

Runtime dependencies arrive through kopf's ``memo`` (see ``__main__``): ``memo.kube`` (a
:class:`Kube`), ``memo.load_source`` ((URL, key prefix) -> :class:`LoadSource`).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple, cast

import kopf

from radixserve.operator import (
    disruption,
    manifests,
    netpol,
    redis_acl,
    scheduler_scale,
    status,
    tls,
    validation,
)
from radixserve.operator.config import OperatorConfig
from radixserve.operator.crds import GROUP, INFERENCE_SERVICE_SPEC, VERSION
from radixserve.operator.kube import Kube, KubeError, load_config
from radixserve.operator.objects import Obj
from radixserve.operator.pool_handlers import PoolEntry, PoolIndex, pool_entry
from radixserve.operator.scaling import (
    LoadSource,
    RedisLoadSource,
    Stabilizer,
    autoscaling,
    scheduler_replicas,
)
from radixserve.operator.schema import apply_defaults, schema_problems

if TYPE_CHECKING:
    import redis

ISVC = (GROUP, VERSION, "inferenceservices")
CONFIG = OperatorConfig.from_env()  # read at import: timer intervals are fixed when handlers register
RESYNC = "resync"  # the param kopf hands reconcile when the resync timer calls it
LoadSourceFactory = Callable[[str, str], LoadSource]  # (Redis URL, key prefix) -> LoadSource


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: object) -> None:
    # Progress and the last-handled spec live in annotations, so status holds only our fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.posting.level = logging.WARNING
    # A deletion waits for a resync timer that is running (a sync reconcile cannot be cancelled);
    # kopf looks again after this many seconds (its default, 60, held every such deletion a minute).
    settings.background.cancellation_polling = 2.0
    if getattr(memo, "kube", None) is None:
        load_config()
        memo.kube = Kube()
    if getattr(memo, "load_source", None) is None:
        memo.load_source = _cached(RedisLoadSource)


def _isvc_spec(spec: Mapping[str, object]) -> Obj:
    """The defaulted spec (apply_defaults descends only into plain dicts, so not kopf's Spec view)."""
    return apply_defaults(INFERENCE_SERVICE_SPEC, dict(spec))


def _cached(factory: LoadSourceFactory) -> LoadSourceFactory:
    sources: dict[tuple[str, str], LoadSource] = {}

    def get(url: str, key_prefix: str) -> LoadSource:
        key = (url, key_prefix)
        return sources.get(key) or sources.setdefault(key, factory(url, key_prefix))

    return get


# ------------------------------------------------------------------------------------ indexes
class GpuClaim(NamedTuple):
    """The ``gpu_claims`` index's value: GPUs one InferenceService's schedulers hold in a pool."""

    service: str  # namespace/name
    gpus: int


GpuClaimIndex = kopf.Index[str, GpuClaim]  # keyed by pool name


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


# ----------------------------------------------------------------------------------- Redis
def _credentials_secret(ctx: manifests.BuildContext) -> Obj | None:
    """The service's Redis credentials Secret, when it has its own user on the chart's Redis."""
    chart = CONFIG.chart_redis
    if chart is None or ctx.spec["redis"]["mode"] != "chart":
        return None
    return redis_acl.credentials_secret(chart, ctx.namespace, ctx.name, manifests.labels(ctx, "redis"))


def _sync_redis_user(ctx: manifests.BuildContext, param: object, logger: kopf.Logger) -> None:
    """Set the service's Redis user (every round: Redis keeps no users across a restart); a service
    that left chart mode loses it (on spec events only). Best effort: Redis down is a warning."""
    chart = CONFIG.chart_redis
    if chart is None or (ctx.spec["redis"]["mode"] != "chart" and param == RESYNC):
        return
    user, password, _ = chart.service_credentials(ctx.namespace, ctx.name)
    prefix = redis_acl.key_prefix(ctx.namespace, ctx.name)
    try:
        admin = _redis_admin(chart.admin_url)
        if ctx.spec["redis"]["mode"] == "chart":
            redis_acl.ensure_user(admin, user, password, prefix)
        elif redis_acl.delete_user(admin, user):  # its keys only then: a SCAN reads the whole keyspace
            keys = redis_acl.delete_keys(admin, prefix)
            logger.info(f"dropped Redis user {user} and {keys} keys: redis.mode is no longer chart")
    except Exception as e:  # redis.RedisError, OSError: retried at the next resync
        logger.warning(f"cannot set Redis user {user} on the chart's Redis: {e}")


def _redis_admin(url: str) -> redis.Redis:
    """redis_acl.admin_client, trusting the operator's Redis CA (if any) on a rediss:// URL."""
    return redis_acl.admin_client(tls.with_ca(url, CONFIG.redis_ca_file))


def _load_url(kube: Kube, ctx: manifests.BuildContext) -> str | None:
    """Where the service's schedulers publish their load (as the service's own Redis user), with the
    operator's Redis CA (if any) on a rediss:// URL."""
    url = _service_redis_url(kube, ctx)
    return tls.with_ca(url, CONFIG.redis_ca_file) if url else None


def _service_redis_url(kube: Kube, ctx: manifests.BuildContext) -> str | None:
    redis = ctx.spec["redis"]
    if redis["mode"] == "chart":
        chart = CONFIG.chart_redis
        return chart.service_credentials(ctx.namespace, ctx.name)[2] if chart else CONFIG.chart_redis_url
    if redis["mode"] == "external":
        ref = redis["urlSecretRef"]
        try:
            secret = kube.get("Secret", ctx.namespace, ref["name"]) or {}
        except KubeError as e:
            if e.status != 403:
                raise
            raise PermissionError(
                f"the operator may not read Secret {ctx.namespace}/{ref['name']} (the external Redis URL):"
                " grant it get there (the chart's rbac.secretReadNamespaces)"
            ) from e
        raw = (secret.get("data") or {}).get(ref.get("key") or "url")
        return base64.b64decode(raw).decode() if raw else None
    return None


# ----------------------------------------------------------------------------- InferenceService
def _autoscale(
    ctx: manifests.BuildContext,
    kube: Kube,
    memo: kopf.Memo,
    patch: kopf.Patch,
    current: Obj,
    logger: kopf.Logger,
) -> int:
    """The scheduler count after one look at the load (unchanged when there is none to see)."""
    # One stabilizer per service: each keeps its own window of recommendations.
    stabilizers: dict[str, Stabilizer] = memo.setdefault("stabilizers", {})
    stabilizer = stabilizers.setdefault(f"{ctx.namespace}/{ctx.name}", Stabilizer())
    try:
        url = _load_url(kube, ctx)
        prefix = redis_acl.key_prefix(ctx.namespace, ctx.name)
        source = memo.load_source(url, prefix) if url else None
        new, decision, said = scheduler_scale.autoscale(ctx, source, stabilizer, current)
    except Exception as e:  # Redis down must not stop reconciling; we just do not scale this round
        logger.warning(f"autoscaling: cannot read scheduler load: {e}")
        return ctx.scheduler_replicas
    if said:
        logger.info(said)
    if decision:
        status.write_status(patch, current, {"autoscaling": decision})
    return new


def _scheduler_count(
    ctx: manifests.BuildContext,
    kube: Kube,
    memo: kopf.Memo,
    patch: kopf.Patch,
    current: Obj,
    logger: kopf.Logger,
    resync: bool,
) -> manifests.BuildContext:
    """``ctx`` with this round's scheduler count: the StatefulSet's own (external), the autoscaler's
    (operator, on resyncs), or as built (the spec's, or the autoscaler's last decision)."""
    mode = autoscaling(ctx.spec).mode
    if mode == "external":
        return dataclasses.replace(ctx, scheduler_replicas=scheduler_scale.external_replicas(kube, ctx))
    if mode == "operator" and resync:
        return dataclasses.replace(
            ctx, scheduler_replicas=_autoscale(ctx, kube, memo, patch, current, logger)
        )
    return ctx


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
    children, autoscaling, a pool that appeared, the Redis user after a Redis restart; it alone
    autoscales.
    """
    assert namespace is not None, "InferenceServices are namespaced"
    kube: Kube = memo.kube
    pools, gpu_claims = _indexes(kw)
    current = dict(status)
    generation = int(body.get("metadata", {}).get("generation") or 1)
    defaulted, pool, problems = _checked_spec(name, spec, pools)
    if problems:
        logger.warning("invalid spec: " + "; ".join(p.message for p in problems))
        _write_degraded(patch, current, problems, generation, observedGeneration=generation)
        return

    ctx = _build_context(name, namespace, defaulted, pool, current)
    _sync_redis_user(ctx, param, logger)
    try:
        ctx = _scheduler_count(ctx, kube, memo, patch, current, logger, resync=param == RESYNC)
    except KubeError as e:  # reading the StatefulSet, or the 409 of a release raced by a write
        raise kopf.TemporaryError(f"scheduler count: {e}", delay=5) from e
    # NetworkPolicies turned off (or never on) are deleted on spec events, not every resync.
    drop_policies = param != RESYNC and not netpol.enabled(defaulted, CONFIG.policies)
    rejected = _apply_children(kube, body, ctx, drop_policies)
    if rejected is not None:
        _write_degraded(patch, current, [rejected], generation)
        return
    _write_observed(patch, current, kube, ctx, _pool_shortfall(ctx, pool, gpu_claims), generation, body)


def _checked_spec(
    name: str, spec: kopf.Spec, pools: PoolIndex
) -> tuple[Obj, PoolEntry | None, list[validation.Problem]]:
    """The defaulted spec, its GPUNodePool's index entry, and the problems (then the spec is {}).

    The API server's schema validation catches most of this first; a spec that reached us anyway
    (an older CRD, unknown fields pruned without strict validation, a server without CEL, an
    emulator) is checked here, and becomes a condition, never a crash loop.
    """
    bad_name = validation.name_problems(name)
    if bad_name:
        return {}, None, bad_name
    schema = schema_problems(INFERENCE_SERVICE_SPEC, dict(spec))
    if schema:
        why = "; ".join(schema[:5])
        return {}, None, [validation.Problem("InvalidSpec", f"spec does not match the schema: {why}")]
    try:
        defaulted = _isvc_spec(spec)
        pool = pool_entry(pools, defaulted["scheduler"].get("nodePool"))
        pool_spec = pool["spec"] if pool else None
        return defaulted, pool, validation.validate(defaulted, pool_spec, CONFIG.chart_redis_url)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return {}, None, [validation.Problem("InvalidSpec", f"spec does not match the schema: {e!r}")]


def _build_context(
    name: str, namespace: str, spec: Obj, pool: PoolEntry | None, current: Obj
) -> manifests.BuildContext:
    ctx = manifests.BuildContext(
        name=name,
        namespace=namespace,
        spec=spec,
        image=spec.get("image") or CONFIG.default_image,
        scheduler_replicas=scheduler_replicas(spec, current),
        chart_redis_url=CONFIG.chart_redis_url,
        pool=pool["spec"] if pool else None,
        pool_name=spec["scheduler"].get("nodePool") or "",
        pod_defaults=CONFIG.pod_defaults,
    )
    secret = _credentials_secret(ctx)
    return dataclasses.replace(ctx, redis_secret=secret["metadata"]["name"]) if secret else ctx


def _children(ctx: manifests.BuildContext) -> list[Obj]:
    """In order: the credentials and the policies before the pods that use (and are bound by) them."""
    secret = _credentials_secret(ctx)
    return [
        *([secret] if secret else []),
        *netpol.build(ctx, CONFIG.policies),
        *manifests.build_all(ctx),
        *disruption.build(ctx),
    ]


def _drop_policies(kube: Kube, ctx: manifests.BuildContext) -> None:
    for component in netpol.COMPONENTS:
        kube.delete("NetworkPolicy", ctx.namespace, manifests.child_name(ctx, component))


def _apply_children(
    kube: Kube, owner: kopf.Body, ctx: manifests.BuildContext, drop_policies: bool = False
) -> validation.Problem | None:
    """Apply every child: the problem when the API server rejects one; API trouble raises (kopf retries).

    The credentials Secret is only ever created (it is immutable and named by its contents)."""
    kind = ""
    try:
        if drop_policies:
            _drop_policies(kube, ctx)
        for obj in _children(ctx):
            kind = obj["kind"]
            kopf.append_owner_reference(obj, owner=owner)
            if obj["kind"] == "Secret":
                kube.create(obj)
            else:
                kube.apply(obj)
    except KubeError as e:
        if e.status == 404 and kind == "Certificate":  # no such kind: cert-manager is not installed
            return validation.Problem(
                "CertManagerMissing",
                "spec.tls.certManager: this cluster has no cert-manager Certificate kind (install"
                " cert-manager, or name a TLS Secret in spec.tls.secretName)",
            )
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
    status.write_status(patch, current, {"conditions": conditions, **fields})


def _write_observed(
    patch: kopf.Patch,
    current: Obj,
    kube: Kube,
    ctx: manifests.BuildContext,
    shortfall: str | None,
    generation: int,
    body: kopf.Body | None = None,
) -> None:
    """Status for a round that applied the children: their readiness, the endpoint, conditions (and
    an Event on ``body`` when Degraded changes)."""
    ready, desired = _observe(kube, ctx)
    instance = {k: v for k, v in manifests.selector(ctx, "scheduler").items() if k != COMPONENT}
    pods = kube.list("Pod", ctx.namespace, labels=instance)
    failure = status.scheduler_failure(
        [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(COMPONENT) == "scheduler"]
    )
    previous = current.get("conditions")
    conditions = status.service_conditions(
        [], shortfall, ready, desired, generation, previous, failure=failure, trouble=status.pod_trouble(pods)
    )
    if body is not None:
        _announce(body, previous, conditions)
    status.write_status(
        patch,
        current,
        {
            "observedGeneration": generation,
            "schedulerReplicas": ctx.scheduler_replicas,
            # The scale subresource's selector (an HPA finds the scheduler pods' metrics by it).
            "selector": ",".join(f"{k}={v}" for k, v in sorted(manifests.selector(ctx, "scheduler").items())),
            "readyReplicas": ready,
            "replicas": {c: f"{ready[c]}/{desired[c]}" for c in desired},
            "endpoint": manifests.endpoints(ctx),
            "conditions": conditions,
        },
    )


COMPONENT = "app.kubernetes.io/component"


def _announce(body: kopf.Body, previous: list[Obj] | None, conditions: list[Obj]) -> None:
    """An Event when the service turns Degraded for a new reason (Warning) or recovers (Normal), so
    `kubectl describe` and event-based alerting see the transition, not only the status."""
    before = next((c for c in previous or [] if c.get("type") == "Degraded"), None)
    after = next(c for c in conditions if c.get("type") == "Degraded")
    was = before is not None and before.get("status") == "True"
    now = after.get("status") == "True"
    if now and (not was or before.get("reason") != after.get("reason")):  # type: ignore[union-attr]
        kopf.event(body, type="Warning", reason=str(after["reason"]), message=str(after.get("message", "")))
    elif was and not now:
        kopf.event(body, type="Normal", reason="Recovered", message="no component reports trouble any more")


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
    """Children go by owner references; here the service's Redis user and keys go from the chart's
    Redis (and its autoscaler's window from memory). Best effort: a Redis that is down must not hold
    the deletion (and, having no persistence, it comes back without them)."""
    assert namespace is not None, "InferenceServices are namespaced"
    memo.setdefault("stabilizers", {}).pop(f"{namespace}/{name}", None)
    if _isvc_spec(spec)["redis"]["mode"] != "chart" or not CONFIG.chart_redis_url:
        return
    chart = CONFIG.chart_redis
    prefix = redis_acl.key_prefix(namespace, name)
    try:
        admin = _redis_admin(chart.admin_url if chart else CONFIG.chart_redis_url)
        if chart is not None:
            existed, keys = redis_acl.drop_user(admin, redis_acl.user_name(namespace, name), prefix)
        else:
            existed, keys = False, redis_acl.delete_keys(admin, prefix)
        logger.info(f"Redis: deleted {keys} keys under {prefix}" + (" and the user" if existed else ""))
    except Exception as e:
        logger.warning(f"could not delete the Redis user and keys of {namespace}/{name}: {e}")
