"""The service settings every pod of an InferenceService reads: the ConfigMap's RADIXSERVE_* variables
(and OpenTelemetry's), from the spec's model (its path, served name and quantization), engine,
KV tiers (kv_cache.py), routing, Redis and tracing fields."""

from __future__ import annotations

from radixserve.common.config import CACHE_DIR_ENV, env_name, env_var
from radixserve.common.service_config import GatewayConfig, SchedulerPodConfig
from radixserve.operator import kv_cache
from radixserve.operator.objects import Obj
from radixserve.operator.redis_acl import key_prefix
from radixserve.operator.volumes import CACHE_DIR, compile_cache_dir, model_path, streamed

# The spec's engine and routing fields are these service settings, camelCased (pageSize: page_size);
# each variable's name comes from the setting (env_var).
_ENGINE_SETTINGS = (
    *("page_size", "chunked_prefill_size", "max_running_requests", "max_total_tokens", "mem_fraction"),
    *("schedule_policy", "fairness_timeout", "dtype", "attention_backend"),
)
_ROUTING_SETTINGS = ("balance_abs_threshold", "balance_rel_threshold")


def _camel(setting: str) -> str:
    first, *rest = setting.split("_")
    return first + "".join(w.title() for w in rest)


def settings(spec: Obj, namespace: str, name: str) -> dict[str, str]:
    """The ConfigMap's data for InferenceService ``namespace/name`` with the defaulted ``spec``:
    RADIXSERVE_* variables every component reads (each ignores the rest)."""
    data = {
        env_name("model"): model_path(spec),
        env_var(SchedulerPodConfig, "host"): "0.0.0.0",
        env_var(GatewayConfig, "block_size"): str(spec["routing"]["blockSize"]),
        env_var(GatewayConfig, "router"): spec["routing"]["policy"],
        env_var(SchedulerPodConfig, "drain_timeout"): str(spec["scheduler"]["drainTimeoutSeconds"]),
        CACHE_DIR_ENV: f"{CACHE_DIR}/radixserve",
        "HOME": CACHE_DIR,  # Hugging Face and torch caches land in the writable emptyDir
        # Kernels compiled once are reused at the next start (the scheduler logs which it reused).
        "FLASHINFER_WORKSPACE_BASE": compile_cache_dir(spec),
        "TRITON_CACHE_DIR": f"{compile_cache_dir(spec)}/triton",
        "TORCHINDUCTOR_CACHE_DIR": f"{compile_cache_dir(spec)}/inductor",
    }
    if spec["redis"]["mode"] != "none":  # one key prefix per service: its Redis user may touch no other
        data[env_var(SchedulerPodConfig, "index_key_prefix")] = key_prefix(namespace, name)
    if spec["model"].get("servedModelName"):
        data[env_name("served_model_name")] = spec["model"]["servedModelName"]
    if streamed(spec):  # the schedulers' --load-format: the weights come from the store at load
        data[env_var(SchedulerPodConfig, "load_format")] = "stream"
    if spec["model"].get("quantization"):  # the schedulers' --quantization (model/quant/)
        data[env_var(SchedulerPodConfig, "quantization")] = spec["model"]["quantization"]
    engine = spec["scheduler"]["engine"]
    for setting in _ENGINE_SETTINGS:
        if engine.get(_camel(setting)) is not None:
            data[env_var(SchedulerPodConfig, setting)] = str(engine[_camel(setting)])
    if engine.get("overlap") is not None:
        data[env_var(SchedulerPodConfig, "disable_overlap")] = "false" if engine["overlap"] else "true"
    data |= kv_cache.settings(spec)  # the schedulers' host and disk KV tiers
    for setting in _ROUTING_SETTINGS:
        if spec["routing"].get(_camel(setting)) is not None:
            data[env_var(GatewayConfig, setting)] = str(spec["routing"][_camel(setting)])
    tracing = spec["tracing"]
    if tracing.get("otlpEndpoint"):
        data["OTEL_EXPORTER_OTLP_ENDPOINT"] = tracing["otlpEndpoint"]
        data["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        data["OTEL_TRACES_SAMPLER_ARG"] = str(tracing["sampleRatio"])
    else:
        data["OTEL_SDK_DISABLED"] = "true"
    return dict(sorted(data.items()))
