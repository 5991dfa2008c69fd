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
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import SpanKind, Tracer
    from opentelemetry.util.types import AttributeValue

_enabled = False
_provider: TracerProvider | None = None

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
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    _enabled = True
    return True


def enabled() -> bool:
    return _enabled


def tracer() -> Tracer:
    from opentelemetry import trace

    return trace.get_tracer("radixserve")


def inject(context: Context | None = None) -> dict[str, str]:
    """The current (or given) span context as W3C headers, for a message's trace_context field."""
    from opentelemetry.propagate import inject as _inject

    carrier: dict[str, str] = {}
    _inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str]) -> Context:
    """A context from W3C headers (a dict, a proto map, or HTTP headers)."""
    from opentelemetry.propagate import extract as _extract

    return _extract(dict(carrier))


def wall_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _MONO_TO_WALL_NS


def span_between(
    name: str,
    parent: Context | None,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, AttributeValue] | None = None,
    kind: SpanKind | None = None,
) -> Context:
    """A finished span over [start_s, end_s] (time.monotonic() readings) under ``parent``; returns it
    (ended) in a context, so callers can parent further spans on it. ``kind``: the tracer's default
    (INTERNAL) when None."""
    from opentelemetry import trace

    span = tracer().start_span(
        name,
        context=parent,
        kind=trace.SpanKind.INTERNAL if kind is None else kind,
        attributes=attributes or {},
        start_time=wall_ns(start_s),
    )
    span.end(end_time=wall_ns(max(end_s, start_s)))
    return trace.set_span_in_context(span, parent)


def shutdown() -> None:
    """Flush what is buffered (at process exit)."""
    if _provider is not None:
        _provider.shutdown()
