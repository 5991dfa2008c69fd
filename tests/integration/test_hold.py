"""Scale to zero and back, at the gateway: with no scheduler serving, requests are held (--hold-timeout,
--max-held-requests) instead of refused, counted in a gauge and in the gateway's Redis load report
(the activation signal), and sent, in arrival order, to the first scheduler that comes up."""

from __future__ import annotations

import asyncio
import time

import httpx

from radixserve.common.ports import free_ports
from radixserve.common.service_config import INDEX_KEY_PREFIX
from radixserve.launcher import Service, build_cluster, counter_by, free_port
from radixserve.operator.scaling import RedisLoadSource
from radixserve.scheduler.startup import PHASES
from tests.helpers.cluster import MODEL_NAME, read_stream
from tests.otlp import attrs, start_receiver
from tests.redis_server import RedisServer

BODY = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _wait(what: str, check, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def _held(url: str) -> float:
    try:
        text = httpx.get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return -1
    line = next((x for x in text.splitlines() if x.startswith("radixserve_held_requests{")), None)
    return float(line.rsplit(" ", 1)[1]) if line else -1


def _second_gateway(first: Service, hold: list[str]) -> tuple[Service, str]:
    """A gateway like ``first`` on new ports, with other hold settings (later flags win)."""
    port, grpc_port = free_ports(2)
    argv = list(first.argv)
    for flag, value in (
        ("--port", port),
        ("--grpc-port", grpc_port),
        ("--advertise-address", f"127.0.0.1:{grpc_port}"),
    ):
        argv[argv.index(flag) + 1] = str(value)
    url = f"http://127.0.0.1:{port}"
    return Service("gateway-2", [*argv, *hold], http_url=url, env=dict(first.env)), url


def _full_then_timed_out(url: str) -> None:
    """A gateway holding at most 1 request for 3 s: the second is a 429, the first a 503 after 3 s,
    both with Retry-After (the hold's length) and naming the flag. (3 s: the second must come while
    the first is held, after a /metrics poll, on a machine that may be loaded.)"""

    async def refused() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as h:
            first = asyncio.create_task(h.post("/v1/completions", json={**BODY, "prompt": "a"}))
            while _held(url) < 1:
                await asyncio.sleep(0.02)
            full = await h.post("/v1/completions", json={**BODY, "prompt": "b"})
            return await first, full

    t0 = time.monotonic()
    timed_out, full = asyncio.run(refused())
    assert full.status_code == 429 and full.headers["Retry-After"] == "3", full.text
    assert "--max-held-requests" in full.json()["error"]["message"]
    assert timed_out.status_code == 503 and timed_out.headers["Retry-After"] == "3", timed_out.text
    assert "--hold-timeout" in timed_out.json()["error"]["message"]
    assert 3.0 <= time.monotonic() - t0 < 15


async def _one_leaves_then_8_held(url: str, redis_url: str, me: str, scheduler: Service) -> list[dict]:
    """A held request whose client goes away, then 8 held one after another (their arrival order is
    known) until the gateway's Redis report says so; then the scheduler starts. Their streams."""
    waiting = asyncio.get_running_loop().run_in_executor
    async with httpx.AsyncClient(base_url=url, timeout=120) as gone:
        left = asyncio.create_task(read_stream(gone, {**BODY, "prompt": "never sent"}))
        await waiting(None, _wait, "one held", lambda: _held(url) == 1)
        left.cancel()  # its client goes away while it is held
    await waiting(None, _wait, "it left the queue", lambda: _held(url) == 0)
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        streams = []
        for i in range(8):
            streams.append(asyncio.create_task(read_stream(h, {**BODY, "prompt": f"held {i}"})))
            await waiting(None, _wait, f"{i + 1} held", lambda i=i: _held(url) == i + 1)
        # The activation signal: the gateway's load report in Redis (the stopped one's is gone).
        # What the operator reads (RedisLoadSource, under the gateway's key prefix).
        reports = RedisLoadSource(redis_url, INDEX_KEY_PREFIX)
        want = {me: {"held": 8, "in_flight": 0}}
        await waiting(None, _wait, "held in Redis", lambda: reports.gateway_loads() == want, 10)
        scheduler.start()  # the first scheduler comes up; the gateway discovers it
        return await asyncio.gather(*streams)


def _startup_phases(scheduler: Service) -> dict[str, float]:
    metrics = httpx.get(scheduler.metrics_url or "", timeout=5).text
    return {
        line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("radixserve_startup_seconds{")
    }


def _check_hold_traces(receiver) -> None:
    """8 hold spans, each having seen the ones before it, released in arrival order; each request's
    TTFT (from its arrival) includes its hold."""

    def holds() -> list[tuple[int, int]]:
        spans = [s for _, s in list(receiver.spans) if s.name == "hold"]
        return sorted((attrs(s)["radixserve.hold.ahead"], s.end_time_unix_nano) for s in spans)

    def roots() -> list:  # a request's root span ends (and is exported) after its hold span
        return [s for _, s in list(receiver.spans) if "radixserve.held_s" in attrs(s)]

    _wait("8 hold spans exported", lambda: len(holds()) == 8, 15)
    _wait("8 held requests' root spans exported", lambda: len(roots()) == 8, 15)
    assert all(attrs(s)["radixserve.ttft_s"] > attrs(s)["radixserve.held_s"] for s in roots())
    got = holds()
    assert [ahead for ahead, _ in got] == list(range(8))
    ends = [end for _, end in got]
    assert ends == sorted(ends), "released out of arrival order"


def test_requests_held_with_no_scheduler_are_served_in_order_by_the_first_one_up(model_dir):
    receiver, otlp, env = start_receiver()
    with RedisServer() as redis:
        hold = ["--hold-timeout", "120", "--max-held-requests", "8"]
        cluster = build_cluster(
            model_dir,
            MODEL_NAME,
            port=free_port(),
            schedulers=1,
            torch_threads=1,
            prefix_index=redis.url,
            env=env,
            gateway_args=["--router", "round-robin", "--schedulers", "discover", *hold],
        )
        short_hold = ["--hold-timeout", "3", "--max-held-requests", "1"]
        short, short_url = _second_gateway(cluster.gateway, short_hold)
        scheduler = cluster.schedulers[0]
        try:
            for s in (cluster.detokenizer, cluster.gateway, short):
                s.start()
            # No scheduler, but holding: the gateways are healthy (a readiness probe keeps them).
            _wait("the gateways hold", lambda: _held(cluster.url) == 0 and _held(short_url) == 0, 120)
            assert httpx.get(f"{cluster.url}/health").json()["status"] == "holding"
            _full_then_timed_out(short_url)
            short.stop(10)

            outs = asyncio.run(
                _one_leaves_then_8_held(cluster.url, redis.url, cluster.grpc_address, scheduler)
            )
            assert all(o["finish"] == "length" and o["error"] is None and o["text"] for o in outs), outs
            assert _held(cluster.url) == 0
            # The disconnected client's request never reached the scheduler: it served the 8.
            served = counter_by(scheduler.metrics_url or "", "radixserve_scheduler_requests", "finish_reason")
            assert sum(served.values()) == 8, served
            # The cold start the held requests waited for, phase by phase, exported and logged.
            phases = _startup_phases(scheduler)
            assert set(phases) == set(PHASES) and phases["weight_load"] > 0, phases
            assert "started in" in scheduler.tail.decode(errors="replace")
            _check_hold_traces(receiver)
        finally:
            short.stop(5)
            cluster.stop(drain_timeout=2)
            otlp.stop(0)
