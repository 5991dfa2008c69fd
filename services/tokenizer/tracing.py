"""One client request's trace at the gateway (a no-op object when tracing is off).

    text_completion MODEL / chat MODEL   (server span; parent: the client's traceparent, if any)
      tokenize, route, submit          made by the gateway
      queue, prefill (per chunk), decode    made by the scheduler pod (children via trace_context)
      detokenize                       made by the detokenizer
      deliver                          first to last result back at the gateway

The root span is an inference span of the OpenTelemetry GenAI conventions (``inference_span``): named
``{gen_ai.operation.name} {gen_ai.request.model}``, with ``gen_ai.provider.name`` "radixserve" (the
conventions' list of providers names hosted services; a self-hosted server names itself), the request
and response models, usage, finish reasons and the response's id. It is the gateway's SERVER span
(the conventions' CLIENT span is the caller's); ``http.request.method`` / ``http.route`` keep what
an HTTP server span's name would have said. Our own attributes are radixserve.*: the request's id
(``radixserve.request_id``: the detokenizer's span and the scheduler's logs know it as the prefix of
their rid), cached tokens, chosen pod, routing policy / reason / matched blocks, TTFT.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry.util.types import AttributeValue

from radixserve.common import telemetry
from radixserve.tokenizer.routing.router import Decision

if TYPE_CHECKING:
    from radixserve.tokenizer.routing.hold_queue import Held
    from radixserve.tokenizer.session import Usage

Attributes = Mapping[str, AttributeValue]

PROVIDER_NAME = "radixserve"  # gen_ai.provider.name: the telemetry's flavour, this server's own


def inference_span(
    operation: str, request_model: str, response_model: str
) -> tuple[str, dict[str, AttributeValue]]:
    """A request's root span name and GenAI attributes. ``operation``: gen_ai.operation.name's
    well-known value ("chat", "text_completion"); ``request_model``: the model the client asked for;
    ``response_model``: the one that answers (the served name)."""
    return f"{operation} {request_model}", {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": request_model,
        "gen_ai.response.model": response_model,
    }


class RequestTrace:
    def __init__(
        self, name: str, carrier: Mapping[str, str], attributes: Attributes, start: float | None = None
    ) -> None:
        """``start``: when the request began (time.monotonic()), if before now (e.g. tokenization)."""
        self.on = telemetry.enabled()
        self.start = time.monotonic() if start is None else start
        self.first_result: float | None = None
        self.last_result: float | None = None
        if not self.on:
            return
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        parent = telemetry.extract(carrier)
        self.span = telemetry.tracer().start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=telemetry.wall_ns(self.start),
        )
        self.ctx = trace.set_span_in_context(self.span, parent)

    def annotate(self, attributes: Attributes) -> None:
        """More attributes of the request's span (known once it began, e.g. the response's id)."""
        if self.on:
            self.span.set_attributes(attributes)

    def carrier(self) -> dict[str, str]:
        """What travels to the scheduler (and on to the detokenizer) in trace_context."""
        return telemetry.inject(self.ctx) if self.on else {}

    def child(self, name: str, start: float, end: float, attributes: Attributes | None = None) -> None:
        if self.on:
            telemetry.span_between(name, self.ctx, start, end, dict(attributes or {}))

    def routed(self, decision: Decision | None, policy: str, start: float, end: float) -> None:
        if self.on and decision is not None:
            attrs: Attributes = {
                "radixserve.pod": decision.pod,
                "radixserve.route.policy": policy,
                "radixserve.route.reason": decision.reason,
                "radixserve.route.matched_blocks": decision.matched_blocks,
                "radixserve.route.matched_host_blocks": decision.matched.host,  # the rest: device
                "radixserve.route.matched_disk_blocks": decision.matched.disk,
                "radixserve.route.score": decision.score,  # tier-weighted
            }
            self.child("route", start, end, attrs)
            self.span.set_attributes(attrs)

    def held(self, held: Held | None) -> None:
        """The request waited for a scheduler (gateway's hold queue): a ``hold`` span, and how long."""
        if self.on and held is not None:
            self.child("hold", held.since, held.until, {"radixserve.hold.ahead": held.position})
            self.span.set_attribute("radixserve.held_s", held.until - held.since)

    def result(self) -> None:
        now = time.monotonic()
        if self.first_result is None:
            self.first_result = now
        self.last_result = now

    def end(self, usage: Usage | None, finish_reasons: list[str], error: str | None = None) -> None:
        if not self.on:
            return
        if self.first_result is not None and self.last_result is not None:
            self.child("deliver", self.first_result, self.last_result)
            self.span.set_attribute("radixserve.ttft_s", self.first_result - self.start)
        if usage is not None:
            self.span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": usage.completion_tokens,
                    "radixserve.cached_tokens": usage.cached_tokens,
                }
            )
        if finish_reasons:
            self.span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, error))
            self.span.set_attribute("error.type", error[:100])
        self.span.end()
