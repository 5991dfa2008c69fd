"""Pure builders: an InferenceService (defaulted spec) in, its child objects out.

    InferenceService NAME
      ConfigMap    NAME-engine        RADIXSERVE_* settings every pod reads (envFrom)
      Deployment   NAME-gateway       python -m radixserve.tokenizer   HTTP 8000 (+/metrics), gRPC 50050
      Service      NAME-gateway       ClusterIP: the endpoint users reach
      StatefulSet  NAME-scheduler     python -m radixserve.scheduler   gRPC 50051, metrics 9400, GPUs
                                      (gpusPerReplica N > 1: --tp-size N, one process per GPU)
      Service      NAME-scheduler     headless: NAME-scheduler-{i}.NAME-scheduler.NS.svc (+ metrics)
      Deployment   NAME-detokenizer   python -m radixserve.detokenizer gRPC 50052, metrics 9401
      Service      NAME-detokenizer   ClusterIP (+ metrics)
      Certificate  NAME-grpc-tls      cert-manager.io/v1, only with spec.tls.certManager (see tls.py)

Schedulers are a StatefulSet, not a Deployment, because the prefix index keys blocks by the address a
scheduler advertises: stable pod names give stable addresses. With a Redis (redis.mode chart or
external) gateways discover the schedulers from their live heartbeats under the service's key prefix
(RADIXSERVE_SCHEDULERS=discover), so a scale change (ours, an HPA's, KEDA's) leaves the gateways
alone; without one (redis.mode none) the gateway takes the static list of pod addresses and rolls on
a scale change. The pod templates carry a hash of the ConfigMap so a settings change rolls every
component, and take the users' pod templates (templates.py) last.

Every Service names its metrics port ``metrics`` (the gateway serves /metrics on ``http``), and every
object carries ``app.kubernetes.io/name: radixserve`` and ``app.kubernetes.io/managed-by:
radixserve-operator``: what a ServiceMonitor or PodMonitor selects.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

from radixserve.common.config import env_var
from radixserve.common.service_config import DetokenizerConfig, GatewayConfig, SchedulerPodConfig
from radixserve.operator import engine_env, kv_cache, scaling, templates, tls
from radixserve.operator.objects import Obj
from radixserve.operator.pods import (
    CONTAINER_SECURITY,
    POD_SECURITY,
    add_shared_memory,
    downward,
    grpc_probes,
    http_probes,
    tp_size,
)
from radixserve.operator.volumes import add_api_keys, add_stream_credentials, model_volumes

# The services' own defaults (service_config.py): the pods run with them.
GATEWAY_HTTP_PORT = GatewayConfig().port
GATEWAY_GRPC_PORT = GatewayConfig().grpc_port
SCHEDULER_PORT = SchedulerPodConfig().port
DETOKENIZER_PORT = DetokenizerConfig().port
SCHEDULER_METRICS_PORT = SchedulerPodConfig().metrics_port  # Prometheus /metrics
DETOKENIZER_METRICS_PORT = DetokenizerConfig().metrics_port
POOL_LABEL = "radixserve.io/gpu-node-pool"
MANAGED_BY = "radixserve-operator"
CONFIG_HASH = "radixserve.io/config-hash"
# The StatefulSet controller labels each scheduler pod controller-revision-hash: NAME-scheduler-HASH
# (HASH: at most 10 characters), and a label value holds at most 63: the tightest limit any child puts
# on an InferenceService's name (Services, NAME-detokenizer, allow 51).
REVISION_HASH_LENGTH = 10
MAX_NAME_LENGTH = 63 - len("-scheduler-") - REVISION_HASH_LENGTH  # 42
# The spec field whose template applies to each component's pods, and every name the operator gives
# a container (volumes.py names the model's init container): a template's entry of that name goes
# only to the pod that has it.
TEMPLATE_FIELDS = {"gateway": "tokenizer", "scheduler": "scheduler", "detokenizer": "detokenizer"}
OPERATOR_CONTAINERS = ("gateway", "scheduler", "detokenizer", "fetch-model")


@dataclass(frozen=True, slots=True)
class BuildContext:
    name: str
    namespace: str
    spec: Obj  # defaulted (crds.apply_defaults)
    image: str  # spec.image or the operator's default
    scheduler_replicas: int  # spec's, or the autoscaler's decision
    chart_redis_url: str = ""  # without credentials
    # redis.mode chart with per-service Redis users: the service's credentials Secret (redis_acl)
    redis_secret: str = ""
    pool: Obj | None = None  # the GPUNodePool's defaulted spec, when scheduler.nodePool names one
    pool_name: str = ""
    pod_defaults: Obj | None = None  # the operator's pod template for every pod (config.py)


def labels(ctx: BuildContext, component: str) -> dict[str, str]:
    return {**selector(ctx, component), "app.kubernetes.io/managed-by": MANAGED_BY}


def selector(ctx: BuildContext, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "radixserve",
        "app.kubernetes.io/instance": ctx.name,
        "app.kubernetes.io/component": component,
    }


def child_name(ctx: BuildContext, component: str) -> str:
    return f"{ctx.name}-{component}"


def _svc_host(ctx: BuildContext, component: str) -> str:
    return f"{child_name(ctx, component)}.{ctx.namespace}.svc"


def scheduler_addresses(ctx: BuildContext) -> list[str]:
    """What the gateway dials and what each scheduler advertises (the prefix index's pod ids)."""
    host = _svc_host(ctx, "scheduler")
    return [
        f"{child_name(ctx, 'scheduler')}-{i}.{host}:{SCHEDULER_PORT}" for i in range(ctx.scheduler_replicas)
    ]


def gateway_schedulers(ctx: BuildContext) -> str:
    """RADIXSERVE_SCHEDULERS: "discover" (from the heartbeats in the service's Redis), or, without
    a Redis, the static list (then a scale change rolls the gateway)."""
    if ctx.spec["redis"]["mode"] != "none":
        return "discover"
    return " ".join(scheduler_addresses(ctx))


def endpoints(ctx: BuildContext) -> dict[str, str]:
    host = _svc_host(ctx, "gateway")
    return {"http": f"http://{host}:{GATEWAY_HTTP_PORT}", "grpc": f"{host}:{GATEWAY_GRPC_PORT}"}


# ----------------------------------------------------------------------------------- ConfigMap
def engine_settings(ctx: BuildContext) -> dict[str, str]:
    """The ConfigMap's data: RADIXSERVE_* variables every component reads (engine_env.py)."""
    return engine_env.settings(ctx.spec, ctx.namespace, ctx.name)


def config_map(ctx: BuildContext) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(ctx, "engine", "config"),
        "data": engine_settings(ctx),
    }


# ------------------------------------------------------------------------------------- pods
def _meta(ctx: BuildContext, suffix: str, component: str) -> Obj:
    return {"name": child_name(ctx, suffix), "namespace": ctx.namespace, "labels": labels(ctx, component)}


def _env(config: type, setting: str, value: str) -> Obj:
    """A container env entry setting ``config``'s ``setting`` (its RADIXSERVE_* name)."""
    return {"name": env_var(config, setting), "value": value}


def _redis_env(ctx: BuildContext) -> list[Obj]:
    """RADIXSERVE_PREFIX_INDEX: a URL with credentials comes from a Secret, never the pod spec."""
    redis = ctx.spec["redis"]
    if redis["mode"] == "chart" and not ctx.redis_secret:  # a chart Redis without ACLs (no admin)
        return [_env(SchedulerPodConfig, "prefix_index", ctx.chart_redis_url)]
    if redis["mode"] == "chart":
        key = {"name": ctx.redis_secret, "key": "url"}
    elif redis["mode"] == "external":
        ref = redis["urlSecretRef"]
        key = {"name": ref["name"], "key": ref.get("key") or "url"}
        if redis.get("caSecretRef"):  # the URL from the Secret, then the mounted CA added to it
            url = f"$({tls.REDIS_URL_VAR})?ssl_ca_certs={tls.REDIS_CA_FILE}"
            return [
                {"name": tls.REDIS_URL_VAR, "valueFrom": {"secretKeyRef": key}},
                {"name": env_var(SchedulerPodConfig, "prefix_index"), "value": url},
            ]
    else:
        return []
    return [{"name": env_var(SchedulerPodConfig, "prefix_index"), "valueFrom": {"secretKeyRef": key}}]


def _pod_template(
    ctx: BuildContext,
    component: str,
    module: str,
    env: list[Obj],
    ports: list[Obj],
    probes: Obj,
    resources: Obj,
    metrics_port: int,
) -> Obj:
    volumes, mounts, inits = model_volumes(ctx.spec, ctx.image)
    container: Obj = {
        "name": component,
        "image": ctx.image,
        "imagePullPolicy": ctx.spec["imagePullPolicy"],
        "command": ["python", "-m", module],
        "envFrom": [{"configMapRef": {"name": child_name(ctx, "engine")}}],
        "env": [
            downward("POD_NAME", "metadata.name"),
            downward("POD_IP", "status.podIP"),
            {"name": "OTEL_SERVICE_NAME", "value": f"radixserve-{component}"},
            {
                "name": "OTEL_RESOURCE_ATTRIBUTES",
                "value": f"k8s.pod.name=$(POD_NAME),k8s.namespace.name={ctx.namespace}",
            },
            *env,
        ],
        "ports": ports,
        **probes,
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY,
    }
    pod: Obj = {
        "securityContext": POD_SECURITY,
        "terminationGracePeriodSeconds": ctx.spec["scheduler"]["drainTimeoutSeconds"] + 15,
        "containers": [container],
        "volumes": volumes,
    }
    if inits:
        pod["initContainers"] = inits
    _add_tls(ctx, pod, container, env)
    return {
        "metadata": {
            "labels": labels(ctx, component),
            "annotations": {
                CONFIG_HASH: config_hash(ctx),
                # The common scrape convention; Prometheus Operator users add a PodMonitor instead.
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(metrics_port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod,
    }


def _add_tls(ctx: BuildContext, pod: Obj, container: Obj, env: list[Obj]) -> None:
    """spec.tls: the Secret and RADIXSERVE_TLS_*, gRPC probes as exec probes; spec.redis.caSecretRef
    (where the pod dials Redis): the CA its RADIXSERVE_PREFIX_INDEX names."""
    redis_ca = ctx.spec["redis"].get("caSecretRef")
    if redis_ca and any(e["name"] == tls.REDIS_URL_VAR for e in env):
        tls.add_redis_ca(pod, container, redis_ca)
    if not tls.enabled(ctx.spec):
        return
    tls.add_grpc_tls(pod, container, ctx.name, ctx.namespace, ctx.spec)
    probes = {k: v for k, v in container.items() if k.endswith("Probe") and "grpc" in v}
    if probes:  # the gateway's are HTTP (plaintext): they stay
        container.update(tls.exec_probes(probes, next(iter(probes.values()))["grpc"]["port"]))


def _default_resources(given: Obj | None, cpu: str, memory: str) -> Obj:
    return given or {"requests": {"cpu": cpu, "memory": memory}}


def config_hash(ctx: BuildContext) -> str:
    return hashlib.sha256(json.dumps(engine_settings(ctx), sort_keys=True).encode()).hexdigest()[:16]


def gateway_deployment(ctx: BuildContext) -> Obj:
    spec = ctx.spec
    env = [
        _env(GatewayConfig, "port", str(GATEWAY_HTTP_PORT)),
        _env(GatewayConfig, "grpc_port", str(GATEWAY_GRPC_PORT)),
        # The detokenizer dials the gateway back: its own pod IP is what it can reach.
        _env(GatewayConfig, "advertise_address", f"$(POD_IP):{GATEWAY_GRPC_PORT}"),
        _env(GatewayConfig, "schedulers", gateway_schedulers(ctx)),
        *(_redis_env(ctx) or [_env(GatewayConfig, "prefix_index", "memory")]),
    ]
    tokenizer = spec["tokenizer"]
    if tokenizer.get("holdTimeoutSeconds"):  # scale to zero: requests wait for a scheduler
        env.append(_env(GatewayConfig, "hold_timeout", f"{tokenizer['holdTimeoutSeconds']:g}"))
    if tokenizer.get("maxHeldRequests"):
        env.append(_env(GatewayConfig, "max_held_requests", str(tokenizer["maxHeldRequests"])))
    ports = [
        {"name": "http", "containerPort": GATEWAY_HTTP_PORT, "protocol": "TCP"},
        {"name": "grpc", "containerPort": GATEWAY_GRPC_PORT, "protocol": "TCP"},
    ]
    resources = _default_resources(spec["tokenizer"].get("resources"), "1", "2Gi")
    template = _pod_template(
        ctx,
        "gateway",
        "radixserve.tokenizer",
        env,
        ports,
        http_probes(GATEWAY_HTTP_PORT),
        resources,
        GATEWAY_HTTP_PORT,  # /metrics is served next to the OpenAI API
    )
    auth = spec["auth"]
    if auth.get("apiKeySecretRef"):
        pod = template["spec"]
        container = pod["containers"][0]
        keys_file = add_api_keys(pod, container, auth["apiKeySecretRef"])
        container["env"].append(_env(GatewayConfig, "api_key_file", keys_file))
    if auth["protectMetrics"]:
        template["spec"]["containers"][0]["env"].append(_env(GatewayConfig, "protect_metrics", "true"))
    return _deployment(ctx, "gateway", spec["tokenizer"]["replicas"], template)


def detokenizer_deployment(ctx: BuildContext) -> Obj:
    spec = ctx.spec
    env = [
        _env(DetokenizerConfig, "port", str(DETOKENIZER_PORT)),
        _env(DetokenizerConfig, "metrics_port", str(DETOKENIZER_METRICS_PORT)),
    ]
    ports = [
        {"name": "grpc", "containerPort": DETOKENIZER_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": DETOKENIZER_METRICS_PORT, "protocol": "TCP"},
    ]
    resources = _default_resources(spec["detokenizer"].get("resources"), "500m", "1Gi")
    template = _pod_template(
        ctx,
        "detokenizer",
        "radixserve.detokenizer",
        env,
        ports,
        grpc_probes(DETOKENIZER_PORT, 90),
        resources,
        DETOKENIZER_METRICS_PORT,
    )
    return _deployment(ctx, "detokenizer", spec["detokenizer"]["replicas"], template)


def _with_templates(ctx: BuildContext, component: str, template: Obj) -> Obj:
    """The pod template with the users' laid over it: the operator's defaults, spec.template, then
    the component's own (templates.py has the rules and what stays ours)."""
    layers = [
        ctx.pod_defaults or {},
        ctx.spec.get("template") or {},
        ctx.spec[TEMPLATE_FIELDS[component]].get("template") or {},
    ]
    return templates.merge_templates(
        template, layers, protected_annotations=(CONFIG_HASH,), reserved=OPERATOR_CONTAINERS
    )


def _deployment(ctx: BuildContext, component: str, replicas: int, template: Obj) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ctx, component, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(ctx, component)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": _with_templates(ctx, component, template),
        },
    }


def scheduler_resources(ctx: BuildContext) -> Obj:
    """The spec's resources plus the GPU limit (extended resources: requests default to limits), and
    the host KV tier's memory (kvCache.hostGiB) on top of the memory asked for."""
    sched = ctx.spec["scheduler"]
    res = copy.deepcopy(sched.get("resources") or {"requests": {"cpu": "4", "memory": "16Gi"}})
    kv_cache.grow_memory(res, ctx.spec)
    gpus = sched["gpusPerReplica"]
    if gpus > 0:
        name = (ctx.pool or {}).get("gpuResourceName", "nvidia.com/gpu")
        res.setdefault("limits", {})[name] = gpus
        res.get("requests", {}).pop(name, None)
    return res


def scheduler_statefulset(ctx: BuildContext) -> Obj:
    sched = ctx.spec["scheduler"]
    host = _svc_host(ctx, "scheduler")
    tp = tp_size(ctx.spec)
    env = [
        _env(SchedulerPodConfig, "port", str(SCHEDULER_PORT)),
        _env(SchedulerPodConfig, "metrics_port", str(SCHEDULER_METRICS_PORT)),
        _env(SchedulerPodConfig, "advertise_address", f"$(POD_NAME).{host}:{SCHEDULER_PORT}"),
        _env(SchedulerPodConfig, "detokenizer", f"{_svc_host(ctx, 'detokenizer')}:{DETOKENIZER_PORT}"),
        _env(SchedulerPodConfig, "device", sched["device"]),
        *([_env(SchedulerPodConfig, "tp_size", str(tp))] if tp > 1 else []),
        *_redis_env(ctx),
    ]
    ports = [
        {"name": "grpc", "containerPort": SCHEDULER_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": SCHEDULER_METRICS_PORT, "protocol": "TCP"},
    ]
    # The scheduler's gRPC server (and so its health service) starts only once the engine is warm:
    # weights loaded, flashinfer's kernels JIT-compiled (minutes on a fresh node), decode graphs
    # captured and a warm-up request run (Engine.warmup). A 30-minute startup budget, then tight probes.
    template = _pod_template(
        ctx,
        "scheduler",
        "radixserve.scheduler",
        env,
        ports,
        grpc_probes(SCHEDULER_PORT, 180, liveness_service="liveness"),
        scheduler_resources(ctx),
        SCHEDULER_METRICS_PORT,
    )
    pod = template["spec"]
    container = pod["containers"][0]
    # A scheduler that cannot serve the model (e.g. --tp-size not dividing its heads) writes why to
    # /dev/termination-log; a crash that writes nothing leaves its last log lines there instead.
    # Either way the operator reads it from the pod and reports Degraded/SchedulerFailed.
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    add_stream_credentials(ctx.spec, container)  # loadFormat stream: the scheduler reads the store
    if tp > 1:
        add_shared_memory(pod, container)  # NCCL between the pod's GPUs
    kv_cache.add_disk(pod, container, ctx.spec)  # the disk KV tier's volume, when kvCache.disk asks
    if ctx.pool is not None:
        _place_on_pool(ctx, ctx.pool, template)
    # No cluster-autoscaler.kubernetes.io/safe-to-evict annotation: a node whose GPUs our schedulers
    # request is not one the cluster autoscaler finds underused, and when a node does go (a drain, a
    # consolidation) the PodDisruptionBudget (disruption.py) takes schedulers one at a time and each
    # finishes its requests at SIGTERM within terminationGracePeriodSeconds (drainTimeoutSeconds + 15).
    # "false" for good would pin GPU nodes forever; by live load it would need a pod patch per change.
    # Who wants it anyway sets it (or karpenter.sh/do-not-disrupt) in spec.scheduler.template.
    spec: Obj = {
        "serviceName": child_name(ctx, "scheduler"),
        "replicas": ctx.scheduler_replicas,
        "podManagementPolicy": "Parallel",  # scale by several pods at once
        "selector": {"matchLabels": selector(ctx, "scheduler")},
        "updateStrategy": {"type": "RollingUpdate"},
        "template": _with_templates(ctx, "scheduler", template),
    }
    if scaling.autoscaling(ctx.spec).mode == "external":
        # An HPA, KEDA or a person scales the StatefulSet itself: applying without the field leaves
        # it to them (server-side apply removes only fields we owned; scheduler_scale hands it over).
        del spec["replicas"]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(ctx, "scheduler", "scheduler"),
        "spec": spec,
    }


def _place_on_pool(ctx: BuildContext, pool: Obj, template: Obj) -> None:
    """Scheduler pods on the GPUNodePool: its own nodeSelector (labels the cloud, Karpenter or the
    node group set, so a pending pod matches a node template the cluster autoscaler can add, not only
    nodes that exist), a toleration for its taint and its tolerations, and the pool's name as a pod
    label (how the pool counts the GPUs they request)."""
    pod = template["spec"]
    pod["nodeSelector"] = dict(pool["nodeSelector"])
    tolerations = list(pool.get("tolerations", []))
    taint = pool.get("taint")
    if taint:
        own = {"key": taint["key"], "operator": "Equal", "value": taint["value"], "effect": taint["effect"]}
        tolerations.insert(0, own)
    if tolerations:
        pod["tolerations"] = tolerations
    template["metadata"]["labels"][POOL_LABEL] = ctx.pool_name


# --------------------------------------------------------------------------------- services
def _service(ctx: BuildContext, component: str, ports: list[Obj], headless: bool = False) -> Obj:
    spec: Obj = {"selector": selector(ctx, component), "ports": ports}
    if headless:
        # Per-pod DNS records exist before readiness, so a starting scheduler can be dialled
        # (the gateway's health checks decide when to route to it).
        spec.update({"clusterIP": "None", "publishNotReadyAddresses": True})
    else:
        spec["type"] = "ClusterIP"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(ctx, component, component), "spec": spec}


def _port(name: str, port: int, app_protocol: str) -> Obj:
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP", "appProtocol": app_protocol}


def gateway_service(ctx: BuildContext) -> Obj:
    ports = [_port("http", GATEWAY_HTTP_PORT, "http"), _port("grpc", GATEWAY_GRPC_PORT, "grpc")]
    return _service(ctx, "gateway", ports)


def scheduler_service(ctx: BuildContext) -> Obj:
    ports = [_port("grpc", SCHEDULER_PORT, "grpc"), _port("metrics", SCHEDULER_METRICS_PORT, "http")]
    return _service(ctx, "scheduler", ports, headless=True)


def detokenizer_service(ctx: BuildContext) -> Obj:
    ports = [_port("grpc", DETOKENIZER_PORT, "grpc"), _port("metrics", DETOKENIZER_METRICS_PORT, "http")]
    return _service(ctx, "detokenizer", ports)


def build_all(ctx: BuildContext) -> list[Obj]:
    """Every child, in the order to apply them (config and services before the pods that use them)."""
    cert = tls.certificate(ctx.name, ctx.namespace, ctx.spec, labels(ctx, "tls"))
    return [
        *([cert] if cert else []),  # before the pods that mount its Secret
        config_map(ctx),
        detokenizer_service(ctx),
        scheduler_service(ctx),
        gateway_service(ctx),
        detokenizer_deployment(ctx),
        scheduler_statefulset(ctx),
        gateway_deployment(ctx),
    ]
