"""OpenTelemetry tracing, set up from the standard environment, shared by every service.

On when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and
``OTEL_SDK_DISABLED`` is not true: spans go to that OTLP/gRPC endpoint in batches, named by
``OTEL_SERVICE_NAME`` (default: the service), sampled by ``OTEL_TRACES_SAMPLER`` /
``OTEL_TRACES_SAMPLER_ARG`` (the SDK's default, parent-based always-on, honours a client's
``traceparent`` sampled flag). Off, nothing is installed and ``enabled()`` is False: callers skip
building spans altogether, so tracing off costs a boolean test.

Context crosses processes as W3C trace-context headers in message fields (``trace_context``).
Spans of engine work are made after the fact, from timestamps, at a request's end: never one span
per token or per step.
"""

from __future__ import annotations

import os
import time
from typing import Any

_enabled = False
_provider: Any = None

# Wall-clock nanoseconds for a time.monotonic() reading (spans need epoch times).
_MONO_TO_WALL_NS = time.time_ns() - time.monotonic_ns()


def setup_tracing(service_name: str) -> bool:
    """Install the SDK if the environment asks for it; returns whether tracing is on."""
    global _enabled, _provider
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name})
    _provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    _enabled = True
    return True


def enabled() -> bool:
    return _enabled


def tracer() -> Any:
    from opentelemetry import trace

    return trace.get_tracer("radixserve")


def inject(context: Any = None) -> dict[str, str]:
    """The current (or given) span context as W3C headers, for a message's trace_context field."""
    from opentelemetry.propagate import inject as _inject

    carrier: dict[str, str] = {}
    _inject(carrier, context=context)
    return carrier


def extract(carrier: Any) -> Any:
    """A context from W3C headers (a dict, a proto map, or HTTP headers)."""
    from opentelemetry.propagate import extract as _extract

    return _extract(dict(carrier))


def wall_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _MONO_TO_WALL_NS


def span_between(
    name: str,
    parent: Any,
    start_s: float,
    end_s: float,
    attributes: dict[str, Any] | None = None,
    kind: Any = None,
) -> Any:
    """A finished span over [start_s, end_s] (time.monotonic() readings) under ``parent``; returns it
    (ended) so callers can parent further spans on it."""
    from opentelemetry import trace

    kwargs: dict[str, Any] = {
        "context": parent,
        "start_time": wall_ns(start_s),
        "attributes": attributes or {},
    }
    if kind is not None:
        kwargs["kind"] = kind
    span = tracer().start_span(name, **kwargs)
    span.end(end_time=wall_ns(max(end_s, start_s)))
    return trace.set_span_in_context(span, parent)


def shutdown() -> None:
    """Flush what is buffered (at process exit)."""
    if _provider is not None:
        _provider.shutdown()
