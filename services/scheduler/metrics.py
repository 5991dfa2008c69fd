"""The scheduler pod's Prometheus metrics (GET /metrics on --metrics-port).

Gauges are read from the engine at scrape time (no cost per step); per-batch histograms are fed
once per engine step by the event loop's ``on_batch`` hook.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.scheduler.batch import ForwardMode, ScheduleBatch

if TYPE_CHECKING:
    from radixserve.scheduler.server import SchedulerService

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)


class _EngineCollector(Collector):
    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = self.service
        sched = s.worker.scheduler
        kv = sched.kv
        lo = s.worker.load()
        yield GaugeMetricFamily("radixserve_scheduler_waiting_requests", "Requests waiting", value=lo.waiting)
        yield GaugeMetricFamily("radixserve_scheduler_running_requests", "Requests running", value=lo.running)
        yield GaugeMetricFamily("radixserve_kv_capacity_tokens", "KV pool capacity", value=kv.capacity)
        yield GaugeMetricFamily("radixserve_kv_used_tokens", "KV held by requests", value=lo.kv_used_tokens)
        yield GaugeMetricFamily(
            "radixserve_kv_cached_tokens", "Evictable prefix cache", value=lo.kv_cached_tokens
        )
        yield GaugeMetricFamily(
            "radixserve_kv_usage_ratio", "Fraction of KV held by requests", value=kv.usage()
        )
        place = s.worker.engine.placement  # sized at start, per rank (tensor parallelism: every rank)
        yield GaugeMetricFamily(
            "radixserve_tp_size", "Devices the model is split across", value=place["tp_size"]
        )
        yield GaugeMetricFamily(
            "radixserve_kv_pool_bytes_per_rank",
            "KV pool bytes on each rank",
            value=place["kv_bytes_per_rank"],
        )
        weights = GaugeMetricFamily("radixserve_weight_bytes", "Model weight bytes per rank", labels=["rank"])
        for rank, size in enumerate(place["weight_bytes_per_rank"]):
            weights.add_metric([str(rank)], size)
        yield weights
        yield CounterMetricFamily(
            "radixserve_retractions", "Decode requests retracted", value=sched.num_retractions
        )
        yield CounterMetricFamily(
            "radixserve_fairness_preemptions",
            "Requests preempted for an overdue one",
            value=sched.num_fairness_preemptions,
        )
        yield CounterMetricFamily("radixserve_engine_steps", "Engine steps", value=s.worker.steps)
        errors = CounterMetricFamily(
            "radixserve_grpc_errors", "Broken gRPC streams by peer", labels=["peer", "code"]
        )
        errors.add_metric([s.out.address, "STREAM_BROKEN"], s.out.errors)
        yield errors
        dropped = CounterMetricFamily(
            "radixserve_grpc_dropped_messages", "Messages dropped for an unreachable peer", labels=["peer"]
        )
        dropped.add_metric([s.out.address], s.out.dropped)
        yield dropped
        pub = s.kv_event_stats()
        yield CounterMetricFamily(
            "radixserve_kv_events_published", "Block events written to the index", value=pub["published"]
        )
        yield CounterMetricFamily(
            "radixserve_kv_event_resyncs", "Index resynchronisations (snapshots)", value=pub["snapshots"]
        )
        yield CounterMetricFamily(
            "radixserve_kv_event_publish_failures", "Failed writes to the index", value=pub["failures"]
        )
        yield GaugeMetricFamily(
            "radixserve_kv_event_publish_lag_seconds",
            "Age of the oldest unpublished event",
            value=pub["lag_s"],
        )


class SchedulerMetrics:
    """The counters the engine thread feeds (EngineWorker), and, once ``collect_from`` names the
    servicer, the gauges read from the pod at scrape time."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.batch_size = Histogram(
            "radixserve_batch_size", "Requests per engine step", ["mode"], registry=r, buckets=_SIZE_BUCKETS
        )
        self.batch_tokens = Histogram(
            "radixserve_batch_tokens",
            "Tokens fed per engine step",
            ["mode"],
            registry=r,
            buckets=(1, 8, 32, 128, 512, 1024, 2048, 4096, 8192),
        )
        self.step_seconds = Histogram(
            "radixserve_step_seconds",
            "Engine step, launch to results",
            ["mode"],
            registry=r,
            buckets=_STEP_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "radixserve_scheduler_prompt_tokens", "Prompt tokens admitted", registry=r
        )
        self.cache_hit_tokens = Counter(
            "radixserve_cache_hit_tokens", "Prompt tokens served from the radix cache", registry=r
        )
        self.requests = Counter(
            "radixserve_scheduler_requests", "Requests ended, by finish reason", ["finish_reason"], registry=r
        )

    def collect_from(self, service: SchedulerService) -> None:
        self.registry.register(_EngineCollector(service))

    def on_batch(self, batch: ScheduleBatch, start: float, end: float) -> None:
        mode = "prefill" if batch.mode is ForwardMode.EXTEND else "decode"
        self.batch_size.labels(mode).observe(batch.size)
        self.batch_tokens.labels(mode).observe(batch.num_tokens)
        self.step_seconds.labels(mode).observe(end - start)
