"""One trace per request across the gateway, scheduler and detokenizer processes, exported over
OTLP to a receiver this test runs, its root span named and described by the OpenTelemetry GenAI
conventions; Prometheus metrics on every service, the model's own labelled with its name; the
scheduler's liveness health service."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from radixserve.common.rpc import pb, pb_grpc
from radixserve.launcher import build_cluster, free_port
from tests.helpers.cluster import MODEL_NAME
from tests.otlp import attrs, start_receiver

ROOT = f"text_completion {MODEL_NAME}"  # GenAI: "{gen_ai.operation.name} {gen_ai.request.model}"
SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind


@pytest.fixture(scope="module")
def traced(model_dir):
    receiver, server, env = start_receiver()
    cluster = build_cluster(model_dir, MODEL_NAME, port=free_port(), schedulers=1, torch_threads=1, env=env)
    cluster.start(timeout=180)
    yield cluster, receiver
    cluster.stop(drain_timeout=2)
    server.stop(0)


def test_one_trace_spans_all_three_services_correctly_parented_and_honours_the_clients_traceparent(traced):
    cluster, receiver = traced
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        timeout=60,
        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        json={
            "model": MODEL_NAME,
            "prompt": "def add(a, b):",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200
    want = {
        ROOT,
        "tokenize",
        "route",
        "submit",
        "scheduler",
        "queue",
        "prefill",
        "decode",
        "detokenize",
        "deliver",
    }
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = receiver.trace(bytes.fromhex(trace_id))
        if want <= {s.name for _, s in spans}:
            break
        time.sleep(0.1)
    names = [s.name for _, s in spans]
    assert all(names.count(n) == 1 for n in want - {"prefill"}), (
        names
    )  # one server span: no framework duplicate
    by_name = {s.name: (svc, s) for svc, s in spans}
    assert want <= set(by_name), sorted(by_name)

    svc, root = by_name[ROOT]
    assert svc == "radixserve-gateway" and root.parent_span_id == bytes.fromhex(client_span)
    assert root.kind == SPAN_KIND_SERVER
    for name in ("tokenize", "route", "submit", "deliver"):
        assert by_name[name][0] == "radixserve-gateway", name
        assert by_name[name][1].parent_span_id == root.span_id, [
            (n.name, n.span_id.hex(), n.parent_span_id.hex()) for _, n in spans
        ]
    svc, sched = by_name["scheduler"]
    assert svc == "radixserve-scheduler" and sched.parent_span_id == root.span_id
    for name in ("queue", "prefill", "decode"):
        assert by_name[name][1].parent_span_id == sched.span_id
    svc, detok = by_name["detokenize"]
    assert svc == "radixserve-detokenizer" and detok.parent_span_id == root.span_id

    a = attrs(root)
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "radixserve"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL_NAME
    assert a["gen_ai.response.id"] == r.json()["id"]
    assert a["http.request.method"] == "POST" and a["http.route"] == "/v1/completions"
    assert (
        a["gen_ai.usage.output_tokens"] == 8
        and a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    )
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert (
        a["radixserve.pod"] == cluster.schedulers[0].grpc_address
        and a["radixserve.route.policy"] == "cache-aware"
    )
    assert 0 < a["radixserve.ttft_s"] < 30 and "radixserve.cached_tokens" in a
    s = attrs(sched)
    assert s["gen_ai.usage.output_tokens"] == 8 and s["radixserve.prefill_chunks"] >= 1
    # One request id end to end: the response's, the gateway's, the scheduler's and the detokenizer's.
    rid = a["radixserve.request_id"]
    assert r.json()["id"] == f"cmpl-{rid}"
    assert s["radixserve.rid"] == attrs(detok)["radixserve.rid"] == f"{rid}-0"


def root_span(receiver, trace_id: str, name: str):
    """The one span named ``name`` in the trace (waiting up to 15 s for the export); a server span."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        roots = [s for _, s in receiver.trace(bytes.fromhex(trace_id)) if s.name == name]
        if roots:
            break
        time.sleep(0.1)
    assert len(roots) == 1, [s.name for _, s in receiver.trace(bytes.fromhex(trace_id))]
    assert roots[0].kind == SPAN_KIND_SERVER
    return roots[0]


def test_a_chat_requests_root_span_is_a_genai_chat_span(traced):
    cluster, receiver = traced
    trace_id = "5cf92f3577b34da6a3ce929d0e0e4737"
    r = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        timeout=60,
        headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b8-01"},
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert r.status_code == 200
    root = root_span(receiver, trace_id, f"chat {MODEL_NAME}")
    a = attrs(root)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "radixserve"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL_NAME
    body = r.json()
    assert a["gen_ai.response.id"] == body["id"] and body["id"].startswith("chatcmpl-")
    assert a["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]
    assert a["http.route"] == "/v1/chat/completions"


def test_a_grpc_generate_calls_root_span_is_a_genai_span_too(traced):
    cluster, receiver = traced
    trace_id = "6af92f3577b34da6a3ce929d0e0e4738"
    request = pb.GenerateRequest(
        model=MODEL_NAME, text="def f():", sampling=pb.SamplingParams(max_new_tokens=3)
    )
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        replies = list(
            pb_grpc.GatewayStub(ch).Generate(
                request, metadata=[("traceparent", f"00-{trace_id}-00f067aa0ba902b8-01")], timeout=60
            )
        )
    a = attrs(root_span(receiver, trace_id, ROOT))
    assert a["gen_ai.provider.name"] == "radixserve" and a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.response.id"] == replies[-1].rid and a["rpc.system"] == "grpc"


def test_the_scheduler_serves_liveness_apart_from_readiness(traced):
    """What the kubelet's probes ask: "liveness" (the engine steps; --stall-timeout's default) and ""."""
    cluster, _ = traced
    with grpc.insecure_channel(cluster.schedulers[0].grpc_address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", ""):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


Series = tuple[str, frozenset[tuple[str, str]]]  # a sample's name and its labels, in any order


def scrape(url: str) -> dict[Series, float]:
    out: dict[Series, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def series(name: str, **labels: str) -> Series:
    return name, frozenset(labels.items())


def test_every_service_serves_prometheus_metrics_consistent_with_the_load_sent(traced):
    cluster, _ = traced
    before = {s.name: scrape(s.metrics_url) for s in cluster.services}
    n, tokens = 12, 5

    async def load() -> list[httpx.Response]:  # concurrent, so the engine batches them
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as h:
            body = {"model": MODEL_NAME, "max_tokens": tokens, "ignore_eos": True}
            return await asyncio.gather(
                *[h.post("/v1/completions", json={**body, "prompt": f"x = {i}"}) for i in range(n)]
            )

    assert all(r.status_code == 200 for r in asyncio.run(load()))
    after = {s.name: scrape(s.metrics_url) for s in cluster.services}

    def delta(svc: str, name: str, **labels: str) -> float:
        key = series(name, **labels)
        return after[svc].get(key, 0.0) - before[svc].get(key, 0.0)

    gw, model = "gateway", {"model_name": MODEL_NAME}  # the model's series carry its name
    assert delta(gw, "radixserve_requests_total", endpoint="/v1/completions", status="200") == n
    assert delta(gw, "radixserve_generation_tokens_total", **model) == n * tokens
    assert delta(gw, "radixserve_requests_finished_total", **model, finish_reason="length") == n
    assert delta(gw, "radixserve_time_to_first_token_seconds_count", **model) == n
    assert delta(gw, "radixserve_inter_token_latency_seconds_count", **model) >= n
    decisions = "radixserve_router_decisions_total"
    assert (
        delta(gw, decisions, policy="cache-aware", reason="no-match")
        + delta(gw, decisions, policy="cache-aware", reason="prefix")
        == n
    )
    sc = "scheduler-0"
    assert delta(sc, "radixserve_scheduler_requests_total", **model, finish_reason="length") == n
    assert delta(sc, "radixserve_batch_size_count", **model, mode="prefill") >= 1
    assert after[sc][series("radixserve_scheduler_running_requests", **model)] == 0
    assert after[sc][series("radixserve_kv_used_tokens", **model)] == 0
    assert after[sc][series("radixserve_engine_stall_seconds", **model)] == 0  # idle: never stalled
    # Every series of the scheduler names the model (vLLM's model_name label, for shared dashboards).
    assert all(dict(labels).get("model_name") == MODEL_NAME for _, labels in after[sc]), [
        name for name, labels in after[sc] if "model_name" not in dict(labels)
    ]
    assert delta("detokenizer", "radixserve_detokenizer_tokens_total") == n * tokens
    assert delta("detokenizer", "radixserve_detokenizer_requests_total", finish_reason="length") == n
