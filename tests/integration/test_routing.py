"""Cache-aware routing across real scheduler processes: a shared prefix lands on one pod."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from radixserve.common.rpc import pb, pb_grpc
from tests.helpers.cluster import MODEL_NAME, start_cluster


def cached_on_each_pod(cluster, ids: list[int]) -> list[int]:
    out = []
    for s in cluster.schedulers:
        with grpc.insecure_channel(s.grpc_address) as ch:
            reply = pb_grpc.SchedulerStub(ch).MatchPrefix(pb.MatchPrefixRequest(input_ids=ids), timeout=10)
            out.append(reply.cached_tokens)
    return out


@pytest.fixture(scope="module")
def four_pods(model_dir):
    c = start_cluster(model_dir, schedulers=4, router="cache-aware")
    yield c
    c.stop(drain_timeout=2)


def complete(cluster, prompt: list[int], max_tokens: int = 4) -> dict:
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        timeout=60,
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_requests_sharing_a_prefix_go_to_one_pod_and_hit_its_cache(four_pods):
    for tenant in range(3):
        system = [100 + tenant * 7 + (i % 50) for i in range(160)]  # 10 full blocks of 16
        usages = [complete(four_pods, system + [1000 + tenant * 10 + k, 1500 + k]) for k in range(6)]
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        for u in usages[1:]:  # every later request found the shared prefix where it was sent
            assert u["prompt_tokens_details"]["cached_tokens"] >= 160
        holders = [n for n in cached_on_each_pod(four_pods, system) if n >= 160]
        assert len(holders) == 1, cached_on_each_pod(four_pods, system)


def test_a_burst_with_a_new_prefix_lands_together(four_pods):
    import asyncio

    system = [700 + (i % 90) for i in range(320)]

    async def burst() -> list[dict]:
        async with httpx.AsyncClient(base_url=four_pods.url, timeout=60) as h:
            rs = await asyncio.gather(
                *[
                    h.post(
                        "/v1/completions",
                        json={
                            "model": MODEL_NAME,
                            "prompt": system + [1900 + k],
                            "max_tokens": 2,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                    for k in range(8)
                ]
            )
        return [r.json()["usage"] for r in rs]

    usages = asyncio.run(burst())
    assert len(usages) == 8
    # Sent before any pod published the prefix: the router's memory of where it just sent it
    # keeps the burst on one pod, so only that pod holds it.
    holders = [n for n in cached_on_each_pod(four_pods, system) if n >= 320]
    assert len(holders) == 1, cached_on_each_pod(four_pods, system)


def test_unrelated_requests_spread_over_the_pods(four_pods):
    for k in range(8):
        complete(four_pods, [50 + k * 31 + (i % 13) for i in range(40)], max_tokens=2)
    with_cache = []
    for k in range(8):
        ids = [50 + k * 31 + (i % 13) for i in range(40)]
        with_cache.append(max(range(4), key=lambda p, ids=ids: cached_on_each_pod(four_pods, ids)[p]))
    assert len(set(with_cache)) >= 3  # least-loaded / rotating choice when nothing matches


def unique_burst(cluster, n: int) -> list[int]:
    """Requests each pod served of ``n`` concurrent ones whose prompts share nothing and are shorter
    than a block (so they leave no working set to spread by), after one long prompt has warmed one
    pod's cache (so the pods' KV figures differ, as they do after any traffic)."""
    import asyncio

    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    complete(cluster, [25 + i % 60 for i in range(400)], max_tokens=1)
    time.sleep(0.5)  # its KV reaches the gateway's view of the pods
    before = cluster.requests_served()

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as h:
            prompts = [[300 + k, *[20 + (k * 7 + i) % 90 for i in range(1 + k % 12)]] for k in range(n)]
            return await asyncio.gather(
                *[h.post("/v1/completions", json={**body, "prompt": p}) for p in prompts]
            )

    assert all(r.status_code == 200 for r in asyncio.run(go()))
    return [b - a for a, b in zip(before, cluster.requests_served(), strict=True)]


def test_concurrent_unique_prompts_spread_over_four_pods(four_pods):
    got = unique_burst(four_pods, 64)
    assert sum(got) == 64 and all(10 <= g <= 22 for g in got), got


def test_concurrent_unique_prompts_spread_over_two_pods(model_dir):
    cluster = start_cluster(model_dir, schedulers=2, router="cache-aware")
    try:
        got = unique_burst(cluster, 32)
        assert sum(got) == 32 and all(12 <= g <= 20 for g in got), got
    finally:
        cluster.stop(drain_timeout=2)


def test_with_redis_a_shared_prefix_lands_on_one_pod_and_routing_survives_a_redis_outage(model_dir):
    from tests.redis_server import RedisServer

    with RedisServer() as redis:
        cluster = start_cluster(model_dir, schedulers=2, router="cache-aware", prefix_index=redis.url)
        try:
            system = [300 + (i % 70) for i in range(192)]
            usages = [complete(cluster, system + [1700 + k]) for k in range(4)]
            assert all(u["prompt_tokens_details"]["cached_tokens"] >= 192 for u in usages[1:])
            assert sorted(n >= 192 for n in cached_on_each_pod(cluster, system)) == [False, True]
            assert redis.client().exists(f"radixserve:p:{cluster.schedulers[0].grpc_address}:hb")

            redis.stop()  # routing degrades to least-load; every request is still served
            for k in range(4):
                complete(cluster, [400 + k] * 40, max_tokens=2)

            redis.start()  # empty: the pods notice their heartbeat was gone and republish
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                c = redis.client()
                if c.exists(f"radixserve:k:{_first_block(system)}"):
                    break
                time.sleep(0.2)
            else:
                raise AssertionError("the index did not heal after Redis came back")
            time.sleep(1.5)  # the gateway retries the index 1 s after its last failure
            u = complete(cluster, system + [1799])
            assert u["prompt_tokens_details"]["cached_tokens"] >= 192
        finally:
            cluster.stop(drain_timeout=2)


def _first_block(ids: list[int]) -> int:
    from radixserve.common.block_hash import block_hashes

    return block_hashes(ids, MODEL_NAME, 16)[0]
