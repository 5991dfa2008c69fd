"""The host KV tier seen from outside a real scheduler process: after a prefix was evicted to the host
and a request brought it back, /metrics counts the tokens each tier served and the bytes and seconds
of the load, and the request's trace holds a kv.load_back span with the same tokens and bytes (nothing
else runs here, so the request joins the step of its load: a load it waited a step for, beside another
request, is spanned in tests/unit/test_host_load_wait.py)."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from radixserve.launcher import Cluster
from tests.helpers.cluster import MODEL_NAME, start_cluster
from tests.integration.test_observability import Series, scrape, series
from tests.otlp import Receiver, attrs, start_receiver

PAGE = 4
PREFIX = 64  # tokens of each conversation's prompt; the device pool holds about two of them
TIERED = [
    *("--host-kv-cache-gb", "0.01", "--max-total-tokens", "160", "--page-size", str(PAGE)),
    *("--max-running-requests", "2", "--disable-overlap"),
]
MODEL = {"model_name": MODEL_NAME}


@pytest.fixture(scope="module")
def traced_tiers(model_dir):
    receiver, server, env = start_receiver()
    cluster = start_cluster(model_dir, schedulers=1, scheduler_args=TIERED, env=env)
    yield cluster, receiver
    cluster.stop(drain_timeout=2)
    server.stop(0)


def _complete(cluster: Cluster, prompt: list[int], headers: dict[str, str] | None = None) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _spans(receiver: Receiver, trace_id: str, want: set[str]) -> list:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = [s for _, s in receiver.trace(bytes.fromhex(trace_id))]
        if want <= {s.name for s in spans}:
            return spans
        time.sleep(0.1)
    raise AssertionError(f"no {want} in {[s.name for s in receiver.trace(bytes.fromhex(trace_id))]}")


def test_a_prefix_loaded_back_from_the_host_is_counted_by_tier_and_traced(traced_tiers) -> None:
    cluster, receiver = traced_tiers
    metrics_url = cluster.schedulers[0].metrics_url
    rng = np.random.default_rng(7)
    prompts = [rng.integers(5, 200, PREFIX).tolist() for _ in range(4)]
    for p in prompts:  # one after another: each evicts the one two before it to the host
        _complete(cluster, p)
    before = scrape(metrics_url)

    trace_id = "7bf92f3577b34da6a3ce929d0e0e4739"
    again = _complete(cluster, [*prompts[0], 3], {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    after = scrape(metrics_url)

    def delta(key: Series) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    host = delta(series("radixserve_kv_hit_tokens_total", **MODEL, tier="host"))
    device = delta(series("radixserve_kv_hit_tokens_total", **MODEL, tier="device"))
    # The whole prompt but its last (partial) page came back from the host: none of it was on the device.
    assert host == PREFIX // PAGE * PAGE and device == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == host
    per_token = (
        after[series("radixserve_kv_pool_bytes_per_rank", **MODEL)]
        / after[series("radixserve_kv_capacity_tokens", **MODEL)]
    )
    loaded_bytes = delta(series("radixserve_kv_load_bytes_total", **MODEL, from_tier="host"))
    assert loaded_bytes == host * per_token > 0
    assert delta(series("radixserve_kv_load_seconds_count", **MODEL, from_tier="host")) == 1
    assert delta(series("radixserve_kv_load_seconds_sum", **MODEL, from_tier="host")) > 0
    assert delta(series("radixserve_kv_host_loaded_tokens_total", **MODEL)) == host
    # the host tier's usage, by the gauges that were there before
    used = after[series("radixserve_kv_host_used_tokens", **MODEL)]
    assert 0 < used <= after[series("radixserve_kv_host_capacity_tokens", **MODEL)]
    assert after[series("radixserve_kv_used_tokens", **MODEL)] == 0  # every device page back after the load

    spans = _spans(receiver, trace_id, {"scheduler", "kv.load_back", "prefill"})
    by_name = {s.name: s for s in spans}
    load, sched, prefill = by_name["kv.load_back"], by_name["scheduler"], by_name["prefill"]
    assert [s.name for s in spans].count("kv.load_back") == 1
    assert load.parent_span_id == sched.span_id
    assert attrs(load) == {
        "radixserve.kv.tokens": host,
        "radixserve.kv.tier": "host",
        "radixserve.kv.bytes": loaded_bytes,
    }
    # the copies run before the forward that reads them: within the prefill step's span
    assert prefill.start_time_unix_nano <= load.start_time_unix_nano <= load.end_time_unix_nano
    assert load.end_time_unix_nano <= prefill.end_time_unix_nano
    assert attrs(sched)["radixserve.cached_tokens"] == host


def test_a_request_served_from_the_device_has_no_load_back_span(traced_tiers) -> None:
    cluster, receiver = traced_tiers
    prompt = np.random.default_rng(8).integers(5, 200, PREFIX).tolist()
    _complete(cluster, prompt)
    before = scrape(cluster.schedulers[0].metrics_url)
    trace_id = "8cf92f3577b34da6a3ce929d0e0e4740"
    _complete(cluster, [*prompt, 3], {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    after = scrape(cluster.schedulers[0].metrics_url)
    key = series("radixserve_kv_hit_tokens_total", **MODEL, tier="device")
    assert after[key] - before[key] == PREFIX // PAGE * PAGE  # straight from the device pool
    names = [s.name for s in _spans(receiver, trace_id, {"scheduler", "prefill"})]
    assert "kv.load_back" not in names
