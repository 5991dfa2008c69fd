"""The gateway's Prometheus metrics (served at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "radixserve_requests",
            "HTTP requests by endpoint and status (gRPC Generate: radixserve_requests_finished)",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "radixserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "radixserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("radixserve_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "radixserve_time_to_first_token_seconds",
            "Time to the first text",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "radixserve_e2e_request_latency_seconds", "Request latency", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "radixserve_inter_token_latency_seconds",
            "Time between a request's successive results, per token",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
        )
        self.finished = Counter(
            "radixserve_requests_finished", "Choices by finish reason", ["finish_reason"], registry=r
        )
        self.route_decisions = Counter(
            "radixserve_router_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
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
            "Requests re-sent to another scheduler because theirs failed before their first token",
            ["reason"],
            registry=r,
        )
        self.in_flight = Gauge("radixserve_requests_in_flight", "Client requests being served", registry=r)
        self.schedulers_up = Gauge("radixserve_schedulers_healthy", "Scheduler pods reachable", registry=r)
