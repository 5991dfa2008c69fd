"""The scheduler pod's Prometheus metrics (GET /metrics on --metrics-port).

Gauges are read from the engine at scrape time (no cost per step); per-batch histograms are fed by
the worker with the batches each event-loop step returns. Every series carries ``model_name``, the
served model's name (as vLLM's metrics do), so dashboards and alerts can tell models apart
when several InferenceServices share one Prometheus.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.scheduler.batch import ForwardMode, ScheduleBatch
from radixserve.scheduler.memory.disk_store import MISS_CAUSES

if TYPE_CHECKING:
    from radixserve.scheduler.memory.host_pool import KVLoad
    from radixserve.scheduler.server import SchedulerService

MODEL_LABEL = "model_name"
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)
# One step's load-back: a page over PCIe takes microseconds, a large prefix on CPU tens of ms.
_LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
_MODES = ("prefill", "decode")


class _Families:
    """Metric families of one scrape, each with the model's label first."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.out: list[Metric] = []

    def gauge(self, name: str, doc: str, value: float) -> None:
        g = GaugeMetricFamily(name, doc, labels=[MODEL_LABEL])
        g.add_metric([self.model], value)
        self.out.append(g)

    def counter(self, name: str, doc: str, value: float) -> None:
        c = CounterMetricFamily(name, doc, labels=[MODEL_LABEL])
        c.add_metric([self.model], value)
        self.out.append(c)

    def labelled(
        self, family: GaugeMetricFamily | CounterMetricFamily, rows: Sequence[tuple[Sequence[str], float]]
    ) -> None:
        for labels, value in rows:
            family.add_metric([self.model, *labels], value)
        self.out.append(family)


class _EngineCollector(Collector):
    def __init__(self, service: SchedulerService, model_name: str) -> None:
        self.service = service
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        f = _Families(self.model_name)
        self._engine(f)
        self._placement(f)
        self._peers(f)
        return iter(f.out)

    def _disk(self, f: _Families) -> None:
        """The disk KV tier (memory/disk_tier.py), when there is one."""
        disk = getattr(self.service.worker.scheduler.kv.cache, "disk", None)
        if disk is None:
            return
        store = disk.store
        f.gauge("radixserve_kv_disk_capacity_bytes", "Disk KV tier bound", store.capacity_bytes)
        f.gauge("radixserve_kv_disk_used_bytes", "Disk KV tier bytes in block files", store.used_bytes)
        f.counter("radixserve_kv_disk_written_tokens", "KV tokens written to disk", disk.written_tokens)
        f.counter("radixserve_kv_disk_read_tokens", "KV tokens read back from disk", disk.read_tokens)
        f.counter(
            "radixserve_kv_disk_dropped_writes", "Blocks not written: the disk writer was too far behind",
            disk.dropped_writes,
        )  # fmt: skip
        f.gauge(
            "radixserve_kv_disk_off", "1: the disk tier turned itself off (full or read-only; one warning)",
            int(disk.off),
        )  # fmt: skip
        misses = CounterMetricFamily(
            "radixserve_kv_disk_misses", "Disk blocks that failed a check (deleted, never served), by cause",
            labels=[MODEL_LABEL, "cause"],
        )  # fmt: skip
        f.labelled(misses, [((cause,), disk.misses[cause]) for cause in MISS_CAUSES])

    def _engine(self, f: _Families) -> None:
        w = self.service.worker
        sched, lo = w.scheduler, w.load()
        f.gauge("radixserve_scheduler_waiting_requests", "Requests waiting", lo.waiting)
        f.gauge("radixserve_scheduler_running_requests", "Requests running", lo.running)
        f.gauge("radixserve_kv_capacity_tokens", "KV pool capacity", sched.kv.capacity)
        f.gauge("radixserve_kv_used_tokens", "KV held by requests", lo.kv_used_tokens)
        f.gauge("radixserve_kv_cached_tokens", "Evictable prefix cache", lo.kv_cached_tokens)
        f.gauge("radixserve_kv_usage_ratio", "Fraction of KV held by requests", sched.kv.usage())
        host, cache = sched.kv.host, sched.kv.cache
        if host is not None:  # the host KV tier
            f.gauge("radixserve_kv_host_capacity_tokens", "Host KV tier capacity", host.capacity_tokens)
            f.gauge("radixserve_kv_host_used_tokens", "Host KV tier tokens held", cache.host_size)
            f.counter(
                "radixserve_kv_host_written_tokens", "KV tokens written back to the host tier",
                cache.written_back_tokens,
            )  # fmt: skip
            f.counter(
                "radixserve_kv_host_loaded_tokens", "KV tokens loaded back from the host tier",
                cache.loaded_tokens,
            )  # fmt: skip
        f.labelled(
            CounterMetricFamily(
                "radixserve_kv_hit_tokens",
                "Prefix tokens admitted requests got from each KV tier instead of computing them",
                labels=[MODEL_LABEL, "tier"],
            ),
            [([tier], n) for tier, n in sched.kv.hit_tokens.items()],
        )
        self._disk(f)
        f.counter("radixserve_retractions", "Decode requests retracted", sched.num_retractions)
        f.counter(
            "radixserve_fairness_preemptions",
            "Requests preempted for an overdue one",
            sched.num_fairness_preemptions,
        )
        f.counter("radixserve_engine_steps", "Engine steps", w.steps)
        f.gauge(
            "radixserve_engine_stall_seconds",
            "Seconds the engine has had work without finishing a step (0 when idle);"
            " the liveness check fails above --stall-timeout",
            w.seconds_since_step(),
        )

    def _placement(self, f: _Families) -> None:
        place = self.service.worker.engine.placement  # sized at start, per rank (tensor parallelism)
        f.gauge("radixserve_tp_size", "Devices the model is split across", place["tp_size"])
        f.gauge("radixserve_kv_pool_bytes_per_rank", "KV pool bytes on each rank", place["kv_bytes_per_rank"])
        f.labelled(
            GaugeMetricFamily(
                "radixserve_weight_bytes",
                "Model weight bytes resident per rank (FP8 weights at one byte, with their scales)",
                labels=[MODEL_LABEL, "rank"],
            ),
            [([str(rank)], size) for rank, size in enumerate(place["weight_bytes_per_rank"])],
        )

    def _peers(self, f: _Families) -> None:
        s = self.service
        f.labelled(
            CounterMetricFamily(
                "radixserve_grpc_errors", "Broken gRPC streams by peer", labels=[MODEL_LABEL, "peer", "code"]
            ),
            [([s.out.address, "STREAM_BROKEN"], s.out.errors)],
        )
        f.labelled(
            CounterMetricFamily(
                "radixserve_grpc_dropped_messages",
                "Messages dropped for an unreachable peer",
                labels=[MODEL_LABEL, "peer"],
            ),
            [([s.out.address], s.out.dropped)],
        )
        pub = s.kv_event_stats()
        f.counter("radixserve_kv_events_published", "Block events written to the index", pub["published"])
        f.counter("radixserve_kv_event_resyncs", "Index resynchronisations (snapshots)", pub["snapshots"])
        f.counter("radixserve_kv_event_publish_failures", "Failed writes to the index", pub["failures"])
        f.gauge(
            "radixserve_kv_event_publish_lag_seconds", "Age of the oldest unpublished event", pub["lag_s"]
        )


class SchedulerMetrics:
    """The counters the engine thread feeds (EngineWorker), and, once ``collect_from`` names the
    servicer, the gauges read from the pod at scrape time; ``model_name`` labels every series."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        by_mode = [MODEL_LABEL, "mode"]
        batch_size = Histogram(
            "radixserve_batch_size", "Requests per engine step", by_mode, registry=r, buckets=_SIZE_BUCKETS
        )
        batch_tokens = Histogram(
            "radixserve_batch_tokens",
            "Tokens fed per engine step",
            by_mode,
            registry=r,
            buckets=(1, 8, 32, 128, 512, 1024, 2048, 4096, 8192),
        )
        step_seconds = Histogram(
            "radixserve_step_seconds",
            "Engine step, launch to results",
            by_mode,
            registry=r,
            buckets=_STEP_BUCKETS,
        )
        # Bound once: the engine thread observes them every step without a label lookup.
        self.batch_size = {m: batch_size.labels(model_name, m) for m in _MODES}
        self.batch_tokens = {m: batch_tokens.labels(model_name, m) for m in _MODES}
        self.step_seconds = {m: step_seconds.labels(model_name, m) for m in _MODES}
        self.prompt_tokens = Counter(
            "radixserve_scheduler_prompt_tokens", "Prompt tokens admitted", [MODEL_LABEL], registry=r
        ).labels(model_name)
        self.cache_hit_tokens = Counter(
            "radixserve_cache_hit_tokens",
            "Prompt tokens served from the radix cache",
            [MODEL_LABEL],
            registry=r,
        ).labels(model_name)
        by_tier = [MODEL_LABEL, "from_tier"]
        self._load_bytes = Counter(
            "radixserve_kv_load_bytes",
            "KV bytes loaded back to the device from a lower tier (every rank's)",
            by_tier,
            registry=r,
        )
        self._timing: deque[KVLoad] = deque()  # loads whose time is not known yet, oldest first
        self._load_seconds = Histogram(
            "radixserve_kv_load_seconds",
            "One step's load-back copies (CPU: their wall time; CUDA: the host gather and the device"
            " time of the transfer and scatter)",
            by_tier,
            registry=r,
            buckets=_LOAD_BUCKETS,
        )
        self._requests = Counter(
            "radixserve_scheduler_requests",
            "Requests ended, by finish reason",
            [MODEL_LABEL, "finish_reason"],
            registry=r,
        )

    def ended(self, finish_reason: str) -> None:
        """A request ended here (any reason: length, stop, abort)."""
        self._requests.labels(self.model_name, finish_reason).inc()

    def collect_from(self, service: SchedulerService) -> None:
        self.registry.register(_EngineCollector(service, self.model_name))

    def on_batch(self, batch: ScheduleBatch, start: float, end: float) -> None:
        mode = "prefill" if batch.mode is ForwardMode.EXTEND else "decode"
        self.batch_size[mode].observe(batch.size)
        self.batch_tokens[mode].observe(batch.num_tokens)
        self.step_seconds[mode].observe(end - start)
        load = batch.kv_load
        if load is not None:
            self._load_bytes.labels(self.model_name, load.from_tier).inc(load.nbytes)
            self._timing.append(load)
        # A load's time is known once its copies are done: at its step's end when the step's forward
        # waited for them (CPU: always), else at a later step's (CUDA: they ran beside the forward).
        # One side stream runs them in order.
        while self._timing and (seconds := self._timing[0].seconds()) is not None:
            self._load_seconds.labels(self.model_name, self._timing.popleft().from_tier).observe(seconds)
