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
from tests.helpers.cluster import (
    MODEL_NAME,
    failovers,
    greedy_body,
    read_grpc_stream,
    read_stream,
    start_cluster,
    stream_completion,
)

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


def _streams_with_a_fault(
    cluster: Cluster, fault, max_tokens: int = MAX_TOKENS
) -> tuple[float, list[dict], list[int]]:
    """32 streams; once every one has its first token, ``fault()``; then 16 more requests."""

    async def go():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as h:
            firsts = [asyncio.Event() for _ in PROMPTS]
            tasks = [
                asyncio.create_task(_stream(h, p, e, max_tokens))
                for p, e in zip(PROMPTS, firsts, strict=True)
            ]
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


def _load(scheduler):
    import grpc

    from radixserve.common.rpc import pb, pb_grpc

    with grpc.insecure_channel(scheduler.grpc_address or "") as ch:
        return pb_grpc.SchedulerStub(ch).GetLoad(pb.LoadRequest(), timeout=5)


def _idle(cluster: Cluster) -> bool:
    return all(not (load.waiting + load.running) for load in map(_load, cluster.schedulers))


def _supervised(model_dir, **kw) -> Cluster:
    cluster = start_cluster(model_dir, schedulers=2, router="cache-aware", **kw)
    cluster.supervise(RestartPolicy(backoff_s=0.5))
    return cluster


def _references(engine, max_tokens: int = MAX_TOKENS) -> list[str]:
    sp = SamplingParams(max_new_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [r["text"] for r in engine.generate(prompt=PROMPTS, sampling_params=sp)]


# Beside the 32 greedy streams: seeded sampled ones with penalties, and JSON-schema ones (seeded) that
# always end with a whole JSON value (40 items, ~200 tokens): each continues exactly where it was.
SEEDED = [
    {"temperature": 1.0, "top_p": 0.95, "seed": 100 + i, "frequency_penalty": 0.4, "presence_penalty": 0.2}
    for i in range(4)
]
SCHEMA = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 40, "maxItems": 40}
MOVED_TOKENS = 400  # the failover tests' streams: mid-flight at the fault, cheaper references
CONSTRAINED = [{"temperature": 1.0, "seed": 7 + i, "guided_json": SCHEMA} for i in range(2)]
# Greedy streams over the gateway's gRPC front: they fail over through the same path as SSE ones.
GRPC_PROMPTS = [f"grpc client {i}: over the lazy dog {i * 31}" for i in range(6)]


def _sampling(extra: dict) -> SamplingParams:
    from radixserve.common.sampling import Constraint

    kw = {k: v for k, v in extra.items() if k != "guided_json"}
    if "guided_json" in extra:
        return SamplingParams(
            max_new_tokens=MOVED_TOKENS, constraint=Constraint("json_schema", json.dumps(SCHEMA)), **kw
        )
    return SamplingParams(max_new_tokens=MOVED_TOKENS, ignore_eos=True, **kw)


def _extras_references(engine) -> list[dict]:
    extras = [*SEEDED, *CONSTRAINED]
    return engine.generate(
        prompt=[f"extra {i}" for i in range(len(extras))], sampling_params=[_sampling(x) for x in extras]
    )


def _streams_and_extras_with_a_fault(
    cluster: Cluster, fault
) -> tuple[float, list[dict], list[dict], list[dict]]:
    """The 32 greedy streams, the extras and the gRPC streams; ``fault()`` once every one has its
    first token."""

    async def go():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=180) as h:
            extras = [*SEEDED, *CONSTRAINED]
            firsts = [asyncio.Event() for _ in range(len(PROMPTS) + len(extras) + len(GRPC_PROMPTS))]
            tasks = [
                asyncio.create_task(_stream(h, p, e, MOVED_TOKENS))
                for p, e in zip(PROMPTS, firsts, strict=False)
            ]
            for i, x in enumerate(extras):
                body = {
                    "model": MODEL_NAME,
                    "prompt": f"extra {i}",
                    "max_tokens": MOVED_TOKENS,
                    "ignore_eos": "guided_json" not in x,
                    "stream_options": {"include_usage": True},
                    **x,
                }
                tasks.append(asyncio.create_task(read_stream(h, body, firsts[len(PROMPTS) + i])))
            for i, p in enumerate(GRPC_PROMPTS):
                first = firsts[len(PROMPTS) + len(extras) + i]
                tasks.append(
                    asyncio.create_task(read_grpc_stream(cluster.grpc_address, p, MOVED_TOKENS, first))
                )
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 90)
            at = time.monotonic()
            fault()
            results = await asyncio.gather(*tasks)
        n, x = len(PROMPTS), len(PROMPTS) + len(extras)
        return at, results[:n], results[n:x], results[x:]

    return asyncio.run(go())


def _resumed_after(times: list[float], at: float) -> float | None:
    """How long after ``at`` a stream's chunks resumed: the chunk after the largest pause that follows
    ``at`` (chunks already on their way from a dead pod come before the pause), None if none came."""
    after = [at, *(t for t in times if t > at)]
    if len(after) == 1:
        return None
    k = max(range(1, len(after)), key=lambda i: after[i] - after[i - 1])
    return after[k] - at


def _continuation_gaps(results: list[dict], at: float) -> list[float]:
    """Per stream still running at the fault: how long after it its chunks resumed."""
    return [g for r in results if (g := _resumed_after(r["chunks"], at)) is not None]


def test_a_killed_scheduler_fails_no_stream_each_goes_on_where_it_was(model_dir, engine):
    """Issue 44: the 32 greedy streams, seeded sampled ones with penalties and JSON-schema ones
    survive a SIGKILLed scheduler: each is continued on the other pod from the tokens its client has,
    its text the undisturbed run's, its usage counting each token once."""
    refs = _references(engine, MOVED_TOKENS)
    extra_refs = _extras_references(engine)
    sp = SamplingParams(max_new_tokens=MOVED_TOKENS, temperature=0, ignore_eos=True)
    grpc_refs = [r["text"] for r in engine.generate(prompt=GRPC_PROMPTS, sampling_params=sp)]
    cluster = _supervised(model_dir)
    victim = cluster.schedulers[0]
    try:
        killed_at, results, extras, grpc_results = _streams_and_extras_with_a_fault(
            cluster, lambda: victim.proc.send_signal(signal.SIGKILL)
        )
        for r, ref in zip(results, refs, strict=True):
            assert r["error"] is None, r["error"]
            assert r["finish"] == "length" and r["text"] == ref
            assert r["usage"]["completion_tokens"] == MOVED_TOKENS  # max_tokens over the whole output
        for r, ref in zip(extras, extra_refs, strict=True):
            assert r["error"] is None, r["error"]
            assert r["text"] == ref["text"] and r["finish"] == ref["finish_reason"]
            assert r["usage"]["completion_tokens"] == len(ref["token_ids"])
        for r in extras[len(SEEDED) :]:
            assert len(json.loads(r["text"])) == 40  # valid JSON across the failover
        for r, ref in zip(grpc_results, grpc_refs, strict=True):  # gRPC clients see one stream too
            assert r["error"] is None, r["error"]
            assert r["finish"] == "length" and r["text"] == ref
            assert r["usage"]["completion_tokens"] == MOVED_TOKENS
        moved = failovers(cluster).get("scheduler/moved", 0)
        assert 8 <= moved <= 30, moved  # the victim had its share of the streams
        gaps = sorted(_continuation_gaps([*results, *extras, *grpc_results], killed_at))
        _wait("the killed scheduler is back", lambda: cluster.gateway_connected() == 2, 60)
        assert victim.restarts == 1
        print(
            "FAULT",
            json.dumps(
                {
                    "fault": "scheduler SIGKILL",
                    "streams": STREAMS + len(extras) + len(grpc_results),
                    "failed": 0,
                    "moved": moved,
                    "next_token_after_fault_s_p50": round(gaps[len(gaps) // 2], 2),
                    "next_token_after_fault_s_max": round(gaps[-1], 2),
                }
            ),
        )
    finally:
        cluster.stop(drain_timeout=2)


def test_a_killed_detokenizer_fails_no_stream_each_goes_on_where_it_was(model_dir, engine):
    """Issue 44: two detokenizer replicas; one SIGKILLed during 32 streams. The streams it was
    delivering are continued (their text through the other replica) with no character repeated or
    lost; the others never notice."""
    refs = _references(engine, MAX_TOKENS)  # long enough to be mid-flight at the kill
    cluster = start_cluster(model_dir, schedulers=2, router="cache-aware", detokenizers=2)
    cluster.supervise(RestartPolicy(backoff_s=0.5))
    running: list[int] = []

    def kill_a_detokenizer_in_use() -> None:
        # Scheduler i sends to detokenizer i first (launcher.py): kill the one the busiest uses.
        running.extend(_load(s).running for s in cluster.schedulers)
        busiest = max(range(len(running)), key=running.__getitem__)
        cluster.detokenizers[busiest % len(cluster.detokenizers)].proc.send_signal(signal.SIGKILL)

    try:
        killed_at, results, after = _streams_with_a_fault(cluster, kill_a_detokenizer_in_use, MAX_TOKENS)
        assert max(running) > 0, running  # the victim was delivering streams
        for r, ref in zip(results, refs, strict=True):
            assert r["error"] is None, r["error"]
            assert r["finish"] == "length" and r["text"] == ref
            assert r["usage"]["completion_tokens"] == MAX_TOKENS
        # Moved by the gateway when it sees the victim's stream break first; when the scheduler
        # reopens to the other replica first, that replica rebuilds each request and nothing moves.
        moved = failovers(cluster).get("detokenizer/moved", 0)
        assert after == [200] * AFTER, after
        _wait(
            "the schedulers are idle again (the moved requests' first runs were aborted)",
            lambda: _idle(cluster),
            10,
        )
        gaps = sorted(_continuation_gaps(results, killed_at))
        print(
            "FAULT",
            json.dumps(
                {
                    "fault": "detokenizer SIGKILL (1 of 2)",
                    "streams": STREAMS,
                    "failed": 0,
                    "moved": moved,
                    "next_token_after_fault_s_p50": round(gaps[len(gaps) // 2], 2),
                    "next_token_after_fault_s_max": round(gaps[-1], 2),
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
                    and len(redis.client().keys("radixserve:k:*")) > 0
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
                # long enough to be running at the kill on a fast machine (~1 ms a token here); traced
                body = greedy_body("victim's running one", 1950)
                traced = {"traceparent": f"00-{'f' * 32}-{1:016x}-01"}
                running = [asyncio.create_task(read_stream(h, body, first[0], traced))]
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
                # Two wait on the victim behind its running one (polled: a fixed sleep was too short
                # on a loaded machine; the survivor's queue may be done by then).
                for _ in range(300):
                    load = await asyncio.to_thread(_load, victim)
                    if load.waiting >= 2:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError(f"the queued requests did not reach the victim: {load}")
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
        # it had streamed: continued on the survivor from its tokens, its usage counting each once
        assert on_victim["error"] is None and on_victim["finish"] == "length"
        assert on_victim["usage"]["completion_tokens"] == 1950
        assert on_survivor["error"] is None and on_survivor["finish"] == "length"
        # the two queued on the victim were re-sent to the survivor; no client saw the failure
        assert [r.status_code for r in queued] == [200] * 4, [r.text for r in queued]
        assert all(r.json()["usage"]["completion_tokens"] == 8 for r in queued)
        # sent as it died: routed around it, or re-sent
        assert [r.status_code for r in right_after] == [200] * 8, [r.text for r in right_after]
        # "down" re-sends, or "submit" ones (taken by the victim, its reply not yet at the gateway)
        retries = _retries(cluster)
        assert retries.get("down", 0) + retries.get("submit", 0) >= 2, retries

        # each moved request's trace shows the move: from the victim (to the survivor)
        def moves() -> list[dict]:
            spans = [s for t in trace_ids for _, s in receiver.trace(bytes.fromhex(t))]
            return [attrs(s) for s in spans if s.name == "retry"]

        _wait("the retries' spans", lambda: len(moves()) >= 2, 10)
        for a in moves():
            assert a["radixserve.retry.from"] == victim.grpc_address
            assert a.get("radixserve.retry.to", survivor.grpc_address) == survivor.grpc_address
        # the streaming one's trace shows its failover: from the victim to the survivor, mid-stream
        _check_failover_span(receiver, "f" * 32, victim.grpc_address, survivor.grpc_address, 1950)
    finally:
        cluster.stop(drain_timeout=2)
        otlp.stop(0)


def _check_failover_span(receiver, trace_id: str, source: str, target: str, max_tokens: int) -> None:
    from tests.otlp import attrs

    def spans() -> list:
        return [s for _, s in receiver.trace(bytes.fromhex(trace_id)) if s.name == "failover"]

    _wait("the failover's span", spans, 10)
    assert len(spans()) == 1
    a = attrs(spans()[0])
    assert a["radixserve.failover.cause"] == "scheduler"
    assert a["radixserve.failover.from"] == source and a["radixserve.failover.to"] == target
    assert 0 < a["radixserve.failover.delivered_tokens"] < max_tokens


def test_a_stopped_scheduler_is_given_up_on_and_its_clients_do_not_wait_forever(model_dir):
    """SIGSTOP: the pod's connections stay open but nothing comes. After the gateway's stale limit
    (5 s) its streams go on on the other pod (continued from what their clients have) and new
    requests go there too."""
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
        assert frozen["error"] is None and frozen["finish"] == "length", frozen["error"]
        assert frozen["usage"]["completion_tokens"] == 1500
        # the stale limit, then the next token from the other pod (chunks still on their way from
        # the stopped one come before that pause, however late a loaded machine delivers them)
        resumed = _resumed_after(frozen["chunks"], stopped_at)
        assert resumed is not None and 4.0 < resumed < 12.0, resumed
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
