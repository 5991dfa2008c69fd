"""A scheduler stopped the way Kubernetes stops a pod (SIGTERM, as in a rollout or a scale-down)
drains: it admits nothing new, finishes what it runs, and no client sees an error.

The gateways find the schedulers by their heartbeats (``--schedulers discover``, what the
operator sets), as in a cluster. Each test prints one ``DRAIN {...}`` line of figures
(``pytest tests/faults/test_drain.py -s``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx

from radixserve.launcher import Cluster, Service, counter_by
from tests.helpers.cluster import MODEL_NAME, start_cluster, stream_completion, wait_not_admitting
from tests.redis_server import RedisServer

STREAMS = 32
MAX_TOKENS = 1500  # the victim's 16 streams take seconds to finish: the SIGTERM lands mid-stream
NEWCOMERS = 16  # requests sent during the drain: every one must go to the other scheduler
DRAIN_TIMEOUT = "60"  # long enough to finish every stream; the test asserts none hits it


def _served(s: Service) -> int:
    """Requests scheduler ``s`` has ended (its radixserve_scheduler_requests counter)."""
    return int(
        sum(counter_by(s.metrics_url or "", "radixserve_scheduler_requests", "finish_reason").values())
    )


def _gateway_counter(cluster: Cluster, family: str, label: str) -> dict[str, float]:
    return counter_by(f"{cluster.url}/metrics", family, label)


async def _stream(
    h: httpx.AsyncClient, prompt: str, first: asyncio.Event, max_tokens: int = MAX_TOKENS
) -> dict:
    return await stream_completion(h, prompt, first, max_tokens)


async def _newcomers(url: str) -> list[httpx.Response]:
    """NEWCOMERS short requests, one every 50 ms (during the drain)."""
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        tasks = []
        for i in range(NEWCOMERS):
            tasks.append(asyncio.create_task(h.post("/v1/completions", json={**body, "prompt": f"new {i}"})))
            await asyncio.sleep(0.05)
        return await asyncio.gather(*tasks)


def _drain_cluster(model_dir, redis: RedisServer, extra: list[str] | None = None) -> Cluster:
    # round-robin: the 32 streams split 16/16, so what the survivor serves is known exactly
    args = ["--drain-timeout", DRAIN_TIMEOUT, *(extra or [])]
    return start_cluster(model_dir, schedulers=2, prefix_index=redis.url, discover=True, scheduler_args=args)


def test_a_scheduler_stopped_during_32_streams_finishes_them_and_new_requests_go_elsewhere(model_dir):
    with RedisServer() as redis:
        cluster = _drain_cluster(model_dir, redis)
        victim, survivor = cluster.schedulers
        try:
            survivor_before = _served(survivor)

            async def go():
                async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as h:
                    firsts = [asyncio.Event() for _ in range(STREAMS)]
                    tasks = [
                        asyncio.create_task(_stream(h, f"client {i}: the quick brown fox", e))
                        for i, e in enumerate(firsts)
                    ]
                    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
                    at = time.monotonic()
                    victim.proc.send_signal(signal.SIGTERM)
                    exited = asyncio.create_task(asyncio.to_thread(victim.proc.wait, 90))
                    # Once the pod has stopped admitting (its signal handler ran): the gateway may not
                    # know yet (its next Watch report) and must still route around it.
                    await asyncio.to_thread(wait_not_admitting, victim)
                    newcomers = asyncio.create_task(_newcomers(cluster.url))
                    results = await asyncio.gather(*tasks)
                    code = await exited
                    return at, time.monotonic(), results, await newcomers, code

            at, exit_seen, results, newcomers, code = asyncio.run(go())
            assert code == 0
            errors = [r["error"] for r in results if r["error"] is not None]
            assert not errors, errors
            assert all(r["finish"] == "length" for r in results)
            assert [r["usage"]["completion_tokens"] for r in results] == [MAX_TOKENS] * STREAMS
            # every stream was mid-way at the signal: text before it and after it (the victim's
            # 16 included, so they finished during its drain)
            before = [sum(t < at for t in r["chunks"]) for r in results]
            after = [sum(t >= at for t in r["chunks"]) for r in results]
            assert min(before) > 0 and min(after) > 0, (before, after)
            assert [r.status_code for r in newcomers] == [200] * NEWCOMERS, [r.text for r in newcomers]
            # the survivor served its 16 streams and every newcomer: none went to the draining pod
            assert _served(survivor) - survivor_before == STREAMS // 2 + NEWCOMERS
            ends = sorted(r["chunks"][-1] for r in results)
            refused = _gateway_counter(cluster, "radixserve_grpc_errors", "code").get("UNAVAILABLE", 0)
            print(
                "DRAIN",
                json.dumps(
                    {
                        "streams": STREAMS,
                        "tokens_each": MAX_TOKENS,
                        "errors": len(errors),
                        "min_chunks_before_sigterm": min(before),
                        "min_chunks_after_sigterm": min(after),
                        "last_stream_end_s": round(ends[-1] - at, 2),
                        "sigterm_to_exit_s": round(exit_seen - at, 2),
                        "newcomers_ok": NEWCOMERS,
                        "submits_refused_by_the_draining_pod": refused,
                    }
                ),
            )
        finally:
            cluster.stop(drain_timeout=2)


def _load(s: Service):
    import grpc

    from radixserve.common.rpc import pb, pb_grpc

    with grpc.insecure_channel(s.grpc_address or "") as ch:
        return pb_grpc.SchedulerStub(ch).GetLoad(pb.LoadRequest(), timeout=5)


def test_requests_queued_on_a_draining_scheduler_are_handed_to_the_other_one(model_dir):
    # One request runs on each pod at a time: the victim runs a long stream, and the next requests
    # wait in its queue. Handed back at the SIGTERM, they run on the other pod and end well before
    # the long stream, which finishes on the draining pod.
    with RedisServer() as redis:
        cluster = _drain_cluster(model_dir, redis, ["--max-running-requests", "1"])
        try:

            async def go():
                async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as h:
                    first = asyncio.Event()
                    body = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True}
                    long_task = asyncio.create_task(_stream(h, "the long one", first, max_tokens=1950))
                    await first.wait()
                    victim = next(s for s in cluster.schedulers if _load(s).running == 1)
                    # round-robin from the pod after the victim's: two on each, the victim's queued
                    queued = [
                        asyncio.create_task(
                            h.post("/v1/completions", json={**body, "prompt": f"queued {i}", "max_tokens": 8})
                        )
                        for i in range(4)
                    ]
                    while _load(victim).waiting < 2:
                        await asyncio.sleep(0.01)
                    at = time.monotonic()
                    victim.proc.send_signal(signal.SIGTERM)
                    done = await asyncio.gather(*queued)
                    queued_done = time.monotonic()
                    long = await long_task
                    return at, queued_done, done, long, await asyncio.to_thread(victim.proc.wait, 60)

            at, queued_done, queued, long, code = asyncio.run(go())
            assert [r.status_code for r in queued] == [200] * 4, [r.text for r in queued]
            assert all(r.json()["usage"]["completion_tokens"] == 8 for r in queued)
            # the long one ran through the SIGTERM and finished on the draining pod
            assert long["error"] is None and long["finish"] == "length"
            assert long["usage"]["completion_tokens"] == 1950
            assert any(t > at for t in long["chunks"])
            assert queued_done < long["chunks"][-1]  # the queued ones did not wait behind it
            assert code == 0
            retries = _gateway_counter(cluster, "radixserve_request_retries", "reason")
            assert retries.get("drain", 0) == 2, retries
            print(
                "DRAIN",
                json.dumps(
                    {
                        "handed_back": retries.get("drain", 0),
                        "queued_done_s": round(queued_done - at, 2),
                        "long_stream_done_s": round(long["chunks"][-1] - at, 2),
                    }
                ),
            )
        finally:
            cluster.stop(drain_timeout=2)
