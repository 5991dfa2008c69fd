"""The gateway's Prometheus metrics (served at GET /metrics).

The model's own series (tokens, latencies, finish reasons, requests in flight) carry ``model_name``,
the served model's name, as the schedulers' do; those of the gateway's plumbing (HTTP status codes by
endpoint, routing, gRPC errors, retries) do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from radixserve.common.kv_tier import TIER_NAMES

if TYPE_CHECKING:
    from radixserve.tokenizer.routing.router import Decision

MODEL_LABEL = "model_name"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _ByModel:
    """A counter whose first label, ``model_name``, is fixed: ``labels`` names the others."""

    def __init__(self, counter: Counter, model_name: str) -> None:
        self.counter = counter
        self.model_name = model_name

    def labels(self, *values: str) -> Counter:
        return self.counter.labels(self.model_name, *values)


class GatewayMetrics:
    def __init__(self, model_name: str = "") -> None:
        """``model_name``: the name this gateway serves its model by (the label's value)."""
        self.registry = CollectorRegistry()
        self._model_series(model_name)
        self._gateway_series()

    def _model_series(self, model_name: str) -> None:
        """The model's series: bound to its name once, so callers inc/observe them as unlabelled ones."""
        r, model = self.registry, [MODEL_LABEL]
        self.prompt_tokens = Counter(
            "radixserve_prompt_tokens", "Prompt tokens of finished requests", model, registry=r
        ).labels(model_name)
        self.cached_tokens = Counter(
            "radixserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache", model, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "radixserve_generation_tokens", "Generated tokens", model, registry=r
        ).labels(model_name)
        self.ttft = Histogram(
            "radixserve_time_to_first_token_seconds",
            "Time to the first text",
            model,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            "radixserve_e2e_request_latency_seconds",
            "Request latency",
            model,
            registry=r,
            buckets=_LATENCY_BUCKETS,
        ).labels(model_name)
        self.itl = Histogram(
            "radixserve_inter_token_latency_seconds",
            "Time between a request's successive results, per token",
            model,
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
        ).labels(model_name)
        self.finished = _ByModel(
            Counter(
                "radixserve_requests_finished",
                "Choices by finish reason",
                [MODEL_LABEL, "finish_reason"],
                registry=r,
            ),
            model_name,
        )
        self.in_flight = Gauge(
            "radixserve_requests_in_flight", "Client requests being served", model, registry=r
        ).labels(model_name)
        # The activation signal of scale to zero (KEDA's trigger; the operator reads it from Redis).
        self.held = Gauge(
            "radixserve_held_requests",
            "Requests waiting at the gateway for a scheduler to come up (--hold-timeout)",
            model,
            registry=r,
        ).labels(model_name)

    def _gateway_series(self) -> None:
        r = self.registry
        self.requests = Counter(
            "radixserve_requests",
            "HTTP requests by endpoint and status (gRPC Generate: radixserve_requests_finished)",
            ["endpoint", "status"],
            registry=r,
        )
        self.route_decisions = Counter(
            "radixserve_router_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.route_matched_blocks = Counter(
            "radixserve_router_matched_blocks",
            "Prefix blocks the chosen pods held when requests were routed there, by the tier each was"
            " on at best (device, host, disk: the tier-weighted score's parts)",
            ["tier"],
            registry=r,
        )
        self.route_seconds = Histogram(
            "radixserve_router_decision_seconds",
            "Time to choose a pod (index lookup included)",
            registry=r,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
        )
        self.grpc_errors = Counter(
            "radixserve_grpc_errors", "Failed gRPC calls by peer and code", ["peer", "code"], registry=r
        )
        self.lost_responses = Counter(
            "radixserve_lost_responses",
            "Requests failed because their scheduler ended them but the response never came",
            registry=r,
        )
        self.internal_errors = Counter(
            "radixserve_internal_errors",
            "Requests that failed on an unexpected exception (answered 500; a bug to report)",
            registry=r,
        )
        self.retries = Counter(
            "radixserve_request_retries",
            "Requests re-sent to another scheduler before their first token; reason: down (theirs"
            " failed), drain (theirs is draining), lost start (it never confirmed the request)",
            ["reason"],
            registry=r,
        )
        self.failovers = Counter(
            "radixserve_stream_failovers",
            "Streams continued elsewhere after their first token (issue 44), by cause (scheduler: its"
            " pod died or stopped answering; detokenizer: the one delivering it died; lost: its final"
            " message never came) and outcome (moved; failed: no scheduler took it; refused: it had"
            " moved --max-failovers times)",
            ["cause", "outcome"],
            registry=r,
        )
        self.schedulers_up = Gauge("radixserve_schedulers_healthy", "Scheduler pods reachable", registry=r)

    def routed(self, policy: str, decision: Decision) -> None:
        """A routing decision: its reason, time and the tiers of the prefix it matched."""
        self.route_decisions.labels(policy, decision.reason).inc()
        self.route_seconds.observe(decision.seconds)
        for tier in TIER_NAMES:
            if n := getattr(decision.matched, tier):
                self.route_matched_blocks.labels(tier).inc(n)
