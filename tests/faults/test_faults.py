"""Kill a scheduler, the detokenizer or Redis in the middle of 32 streams: what clients see, and how
soon the service is whole again.

Each test prints one ``FAULT {...}`` line of figures (``pytest tests/faults -s``); docs/reliability.md
quotes them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx

from radixserve.common.sampling import SamplingParams
from radixserve.launcher import Cluster, RestartPolicy, counter_by
from tests.helpers.cluster import MODEL_NAME, start_cluster, stream_completion

STREAMS = 32
MAX_TOKENS = 1200  # long enough that every stream is mid-flight at the fault
PROMPTS = [f"client {i}: the quick brown fox {i * 7919 % 1000}" for i in range(STREAMS)]
AFTER = 16  # requests sent once the victim's streams have ended: every one must succeed


async def _stream(
    h: httpx.AsyncClient, prompt: str, first: asyncio.Event, max_tokens: int = MAX_TOKENS
) -> dict:
    return await stream_completion(h, prompt, first, max_tokens)


async def _after(url: str) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        rs = await asyncio.gather(
            *[h.post("/v1/completions", json={**body, "prompt": f"after {i}"}) for i in range(AFTER)]
        )
    bad = [r.text for r in rs if r.status_code != 200]
    assert not bad, bad
    return [r.status_code for r in rs]


def _streams_with_a_fault(cluster: Cluster, fault) -> tuple[float, list[dict], list[int]]:
    """32 streams; once every one has its first token, ``fault()``; then 16 more requests."""

    async def go():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as h:
            firsts = [asyncio.Event() for _ in PROMPTS]
            tasks = [asyncio.create_task(_stream(h, p, e)) for p, e in zip(PROMPTS, firsts, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
            at = time.monotonic()
            fault()
            results = await asyncio.gather(*tasks)
        return at, results, await _after(cluster.url)

    return asyncio.run(go())


def _wait(what: str, check, timeout: float) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)
    return time.monotonic()


def _idle(cluster: Cluster) -> bool:
    import grpc

    from radixserve.common.rpc import pb, pb_grpc

    for s in cluster.schedulers:
        with grpc.insecure_channel(s.grpc_address or "") as ch:
            load = pb_grpc.SchedulerStub(ch).GetLoad(pb.LoadRequest(), timeout=5)
        if load.waiting + load.running:
            return False
    return True


def _supervised(model_dir, **kw) -> Cluster:
    cluster = start_cluster(model_dir, schedulers=2, router="cache-aware", **kw)
    cluster.supervise(RestartPolicy(backoff_s=0.5))
    return cluster


def _references(engine) -> list[str]:
    sp = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [r["text"] for r in engine.generate(prompt=PROMPTS, sampling_params=sp)]


def test_a_killed_scheduler_fails_only_its_own_streams_and_comes_back(model_dir, engine):
    refs = _references(engine)
    cluster = _supervised(model_dir)
    victim = cluster.schedulers[0]
    try:
        killed_at, results, after = _streams_with_a_fault(
            cluster, lambda: victim.proc.send_signal(signal.SIGKILL)
        )
        failed = [r for r in results if r["error"] is not None]
        for r, ref in zip(results, refs, strict=True):
            if r["error"] is None:  # on the other pod: complete and correct
                assert r["finish"] == "length" and r["text"] == ref
            else:  # on the victim: a clear, retryable error, soon
                assert "went away" in r["error"] and "retry" in r["error"], r["error"]
                assert r["ended"] - killed_at < 5.0
        assert 8 <= len(failed) <= 24, len(failed)  # the victim had its share, no more
        assert after == [200] * AFTER, after
        up_at = _wait("the killed scheduler is back", lambda: cluster.gateway_connected() == 2, 60)
        # ... and receiving traffic: what it serves from now on counts from zero
        served_at = _wait(
            "it serves again",
            lambda: asyncio.run(_after(cluster.url)) and cluster.requests_served()[0] > 0,
            60,
        )
        assert victim.restarts == 1
        worst = max(r["ended"] for r in failed) - killed_at
        print(
            "FAULT",
            json.dumps(
                {
                    "fault": "scheduler SIGKILL",
                    "streams": STREAMS,
                    "failed": len(failed),
                    "completed_correct": STREAMS - len(failed),
                    "last_failure_s": round(worst, 2),
                    "after_ok": after.count(200),
                    "back_s": round(up_at - killed_at, 1),
                    "serving_s": round(served_at - killed_at, 1),
                }
            ),
        )
    finally:
        cluster.stop(drain_timeout=2)


def test_a_killed_detokenizer_fails_the_streams_in_flight_and_comes_back(model_dir, engine):
    refs = _references(engine)
    cluster = _supervised(model_dir)
    detok = cluster.detokenizer
    try:
        killed_at, results, after = _streams_with_a_fault(
            cluster, lambda: detok.proc.send_signal(signal.SIGKILL)
        )
        # Every stream was mid-flight: its place in the text died with the detokenizer. Each ends
        # at once with an error that says so; none hangs, none is cut or garbled silently.
        for r, ref in zip(results, refs, strict=True):
            if r["error"] is None:
                assert r["finish"] == "length" and r["text"] == ref
            else:
                assert "detokenizer" in r["error"] and "retry" in r["error"], r["error"]
                assert r["ended"] - killed_at < 5.0
        failed = [r for r in results if r["error"] is not None]
        assert failed, "no stream saw the detokenizer die"
        assert after == [200] * AFTER, after
        _wait("the schedulers are idle again (the failed requests were aborted)", lambda: _idle(cluster), 10)
        assert detok.restarts == 1 and detok.alive()
        worst = max((r["ended"] for r in results), default=killed_at) - killed_at
        print(
            "FAULT",
            json.dumps(
                {
                    "fault": "detokenizer SIGKILL",
                    "streams": STREAMS,
                    "failed": len(failed),
                    "completed_correct": STREAMS - len(failed),
                    "all_ended_s": round(worst, 2),
                    "after_ok": after.count(200),
                }
            ),
        )
    finally:
        cluster.stop(drain_timeout=2)


def test_redis_restarted_under_load_routing_goes_on_and_the_index_refills(model_dir):
    from tests.redis_server import RedisServer

    with RedisServer() as redis:
        cluster = _supervised(model_dir, prefix_index=redis.url)
        try:

            def fault() -> None:
                redis.stop()  # gone: routing degrades to least-load
                time.sleep(1.0)
                redis.start()  # back, empty

            restarted_at, results, after = _streams_with_a_fault(cluster, fault)
            assert all(r["error"] is None and r["finish"] == "length" for r in results)
            assert after == [200] * AFTER, after
            hb = [f"radixserve:p:{s.grpc_address}:hb" for s in cluster.schedulers]
            healed_at = _wait(
                "the index holds both pods' blocks again",
                lambda: (
                    all(redis.client().exists(k) for k in hb)
                    and len(redis.client().keys("radixserve:b:*")) > 0
                ),
                30,
            )
            print(
                "FAULT",
                json.dumps(
                    {
                        "fault": "redis restart",
                        "streams": STREAMS,
                        "failed": 0,
                        "after_ok": after.count(200),
                        "index_back_s": round(healed_at - restarted_at, 1),
                    }
                ),
            )
        finally:
            cluster.stop(drain_timeout=2)


def _retries(cluster: Cluster) -> dict[str, float]:
    return counter_by(f"{cluster.url}/metrics", "radixserve_request_retries", "reason")


def test_requests_without_a_token_yet_move_to_the_other_scheduler(model_dir):
    # One running request per pod, so the next ones wait in the pods' queues; round-robin, so the
    # test knows which pod each request is on (even: scheduler 0, the victim).
    from tests.otlp import attrs, start_receiver

    receiver, otlp, env = start_receiver()
    cluster = start_cluster(model_dir, schedulers=2, scheduler_args=["--max-running-requests", "1"], env=env)
    victim, survivor = cluster.schedulers
    trace_ids = [f"{i + 1:032x}" for i in range(4)]
    try:

        async def go():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as h:
                first = [asyncio.Event(), asyncio.Event()]
                # long enough to be running at the kill on a fast machine (~1 ms a token here)
                running = [asyncio.create_task(_stream(h, "victim's running one", first[0], 1950))]
                await first[0].wait()  # one at a time: round-robin sends them in this order
                running.append(asyncio.create_task(_stream(h, "the survivor's", first[1], 400)))
                await first[1].wait()
                body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                queued = [
                    asyncio.create_task(
                        h.post(
                            "/v1/completions",
                            json={**body, "prompt": f"queued {i}"},
                            headers={"traceparent": f"00-{trace_ids[i]}-{i + 1:016x}-01"},
                        )
                    )
                    for i in range(4)
                ]
                await asyncio.sleep(0.5)  # submitted: two wait on each pod behind its running one
                victim.proc.send_signal(signal.SIGKILL)
                right_after = [
                    asyncio.create_task(h.post("/v1/completions", json={**body, "prompt": f"next {i}"}))
                    for i in range(8)
                ]
                return (
                    await asyncio.gather(*running),
                    await asyncio.gather(*queued),
                    await asyncio.gather(*right_after),
                )

        (on_victim, on_survivor), queued, right_after = asyncio.run(go())
        assert on_victim["error"] is not None and "went away" in on_victim["error"]  # it had streamed
        assert on_survivor["error"] is None and on_survivor["finish"] == "length"
        # the two queued on the victim were re-sent to the survivor; no client saw the failure
        assert [r.status_code for r in queued] == [200] * 4, [r.text for r in queued]
        assert all(r.json()["usage"]["completion_tokens"] == 8 for r in queued)
        # sent as it died: routed around it, or re-sent
        assert [r.status_code for r in right_after] == [200] * 8, [r.text for r in right_after]
        retries = _retries(cluster)
        assert retries.get("down", 0) >= 2, retries

        # each moved request's trace shows the move: from the victim to the survivor
        def moves() -> list[dict]:
            spans = [s for t in trace_ids for _, s in receiver.trace(bytes.fromhex(t))]
            return [attrs(s) for s in spans if s.name == "retry"]

        _wait("the retries' spans", lambda: len(moves()) >= 2, 10)
        for a in moves():
            assert a["radixserve.retry.from"] == victim.grpc_address
            assert a["radixserve.retry.to"] == survivor.grpc_address
    finally:
        cluster.stop(drain_timeout=2)
        otlp.stop(0)


def test_a_stopped_scheduler_is_given_up_on_and_its_clients_do_not_wait_forever(model_dir):
    """SIGSTOP: the pod's connections stay open but nothing comes. After the gateway's stale limit
    (5 s) its streams end with an error and new requests go to the other pod."""
    cluster = start_cluster(model_dir, schedulers=2)
    victim = cluster.schedulers[0]
    try:

        async def go():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as h:
                first = [asyncio.Event(), asyncio.Event()]
                tasks = []
                for i in range(2):  # one at a time: round-robin sends them in this order
                    tasks.append(asyncio.create_task(_stream(h, f"stream {i}", first[i], 1500 - 1300 * i)))
                    await first[i].wait()
                stopped_at = time.monotonic()
                victim.proc.send_signal(signal.SIGSTOP)
                results = await asyncio.gather(*tasks)
                return stopped_at, results, await _after(cluster.url)

        stopped_at, (frozen, fine), after = asyncio.run(go())
        assert frozen["error"] is not None and "sent nothing" in frozen["error"], frozen
        assert 4.0 < frozen["ended"] - stopped_at < 12.0
        assert fine["error"] is None and fine["finish"] == "length"
        assert after == [200] * AFTER
        # Resumed after the gateway's Abort call to it timed out (10 s), it still holds the request
        # its gateway gave up on: that abort is sent again when it reports, instead of it running
        # the request to its end for nobody.
        time.sleep(max(0.0, frozen["ended"] + 11.0 - time.monotonic()))
        victim.proc.send_signal(signal.SIGCONT)
        _wait("the victim ended its request", lambda: _ended_by_reason(victim).get("abort", 0) >= 1, 30)
        assert _ended_by_reason(victim).get("length", 0) == 0
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        cluster.stop(drain_timeout=2)


def _ended_by_reason(scheduler) -> dict[str, float]:
    return counter_by(scheduler.metrics_url, "radixserve_scheduler_requests", "finish_reason")
