"""One trace per request across the gateway, scheduler and detokenizer processes, exported over
OTLP to a receiver this test runs; Prometheus metrics on every service."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from radixserve.launcher import build_cluster, free_port
from tests.integration.conftest import MODEL_NAME
from tests.otlp import attrs, start_receiver


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
        "POST /v1/completions",
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

    svc, root = by_name["POST /v1/completions"]
    assert svc == "radixserve-gateway" and root.parent_span_id == bytes.fromhex(client_span)
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
    assert a["gen_ai.request.model"] == MODEL_NAME
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


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+.\deE]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


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

    def delta(svc: str, key: str) -> float:
        return after[svc].get(key, 0.0) - before[svc].get(key, 0.0)

    gw = "gateway"
    assert delta(gw, 'radixserve_requests_total{endpoint="/v1/completions",status="200"}') == n
    assert delta(gw, "radixserve_generation_tokens_total") == n * tokens
    assert delta(gw, 'radixserve_requests_finished_total{finish_reason="length"}') == n
    assert delta(gw, "radixserve_time_to_first_token_seconds_count") == n
    assert delta(gw, "radixserve_inter_token_latency_seconds_count") >= n
    assert (
        delta(gw, 'radixserve_router_decisions_total{policy="cache-aware",reason="no-match"}')
        + delta(gw, 'radixserve_router_decisions_total{policy="cache-aware",reason="prefix"}')
        == n
    )
    sc = "scheduler-0"
    assert delta(sc, 'radixserve_scheduler_requests_total{finish_reason="length"}') == n
    assert delta(sc, 'radixserve_batch_size_count{mode="prefill"}') >= 1
    assert after[sc]["radixserve_scheduler_running_requests"] == 0
    assert after[sc]["radixserve_kv_used_tokens"] == 0
    assert delta("detokenizer", "radixserve_detokenizer_tokens_total") == n * tokens
    assert delta("detokenizer", 'radixserve_detokenizer_requests_total{finish_reason="length"}') == n
