"""Pods that die or are stopped: clients get a prompt, clear error; everyone else is unaffected."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import httpx
import pytest

from radixserve.launcher import counter_by
from tests.helpers.cluster import MODEL_NAME, read_stream, start_cluster, wait_not_admitting
from tests.helpers.procs import descendants, running, service_names

LONG = {
    "model": MODEL_NAME,
    "prompt": "x" * 40,
    "max_tokens": 1500,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
SHORT = {**LONG, "max_tokens": 40}


def test_with_failover_off_a_killed_scheduler_fails_its_clients_promptly_and_spares_the_others(model_dir):
    # --max-failovers 0: the streams are not continued elsewhere (tests/faults: they are by default)
    cluster = start_cluster(model_dir, schedulers=2, gateway_args=["--max-failovers", "0"])
    try:

        async def go():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as h:
                # round-robin: requests 0 and 2 go to scheduler 0, 1 and 3 to scheduler 1 (each is
                # started once the one before it streams, so they reach the gateway in order)
                tasks = []
                for i in range(4):
                    started = asyncio.Event()
                    tasks.append(asyncio.create_task(read_stream(h, LONG if i % 2 == 0 else SHORT, started)))
                    await started.wait()
                killed_at = time.monotonic()
                cluster.schedulers[0].proc.send_signal(signal.SIGKILL)
                results = await asyncio.gather(*tasks)
                after = await h.post("/v1/completions", json={**SHORT, "stream": False, "max_tokens": 4})
                return killed_at, results, after

        killed_at, results, after = asyncio.run(go())
        for r in results[0::2]:  # on the killed pod
            assert r["error"] is not None and "went away" in r["error"], results
            assert r["ended"] - killed_at < 5.0
        for r in results[1::2]:  # on the other pod
            assert r["error"] is None and r["finish"] == "length"
        assert after.status_code == 200  # routed to the live pod
        assert after.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop(drain_timeout=2)


def _restart(service, timeout: float = 60.0) -> None:
    service.start()
    deadline = time.monotonic() + timeout
    while not service.healthy():
        assert service.alive() and time.monotonic() < deadline, f"{service.name} did not come back"
        time.sleep(0.1)


def _idle(cluster, timeout: float = 10.0) -> bool:
    """Every scheduler back to no waiting or running request (what the gateway's aborts free)."""
    from radixserve.common.rpc import pb, pb_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = []
        for s in cluster.schedulers:
            with grpc.insecure_channel(s.grpc_address) as ch:
                loads.append(pb_grpc.SchedulerStub(ch).GetLoad(pb.LoadRequest(), timeout=5))
        if all(x.waiting + x.running == 0 for x in loads):
            return True
        time.sleep(0.2)
    return False


def _wait_finished(scheduler, n: int, timeout: float = 30.0) -> None:
    """Until ``scheduler`` has ended ``n`` requests (its per-reason counter, summed)."""
    deadline = time.monotonic() + timeout
    while (
        sum(counter_by(scheduler.metrics_url, "radixserve_scheduler_requests", "finish_reason").values()) < n
    ):
        assert time.monotonic() < deadline, f"the scheduler did not end {n} requests in {timeout:.0f} s"
        time.sleep(0.1)


def test_with_failover_off_a_detokenizer_restart_mid_stream_fails_the_stream_and_frees_its_kv(model_dir):
    cluster = start_cluster(model_dir, schedulers=1, gateway_args=["--max-failovers", "0"])
    try:

        async def go():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as h:
                started = asyncio.Event()
                task = asyncio.create_task(read_stream(h, LONG, started))
                await started.wait()
                cluster.detokenizer.proc.send_signal(signal.SIGKILL)
                cluster.detokenizer.proc.wait()
                await asyncio.to_thread(_restart, cluster.detokenizer)
                restarted_at = time.monotonic()
                result = await task
                after = await h.post("/v1/completions", json={**SHORT, "stream": False, "max_tokens": 4})
                return restarted_at, result, after

        restarted_at, result, after = asyncio.run(go())
        # the gateway saw the dead detokenizer's stream end: nothing more of this text can come
        assert result["error"] is not None and "detokenizer" in result["error"]
        assert "retry the request" in result["error"]
        assert result["finish"] is None and result["ended"] - restarted_at < 10
        assert _idle(cluster)  # the gateway aborted it on the scheduler: its KV is free
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop(drain_timeout=2)


def test_a_response_lost_with_a_dying_detokenizer_is_failed_not_left_hanging(model_dir):
    cluster = start_cluster(model_dir, schedulers=1, gateway_args=["--lost-response-check", "1.5"])
    try:

        async def go():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as h:
                cluster.detokenizer.proc.send_signal(signal.SIGSTOP)  # its inbox fills, nothing comes out
                task = asyncio.create_task(h.post("/v1/completions", json={**SHORT, "stream": False}))
                # the scheduler finished it (counted before its final message leaves): the text is in
                # flight (an idle scheduler alone may be one the request has not reached yet)
                await asyncio.to_thread(_wait_finished, cluster.schedulers[0], 1)
                cluster.detokenizer.proc.send_signal(signal.SIGKILL)  # ... and dies with it
                cluster.detokenizer.proc.wait()
                await asyncio.to_thread(_restart, cluster.detokenizer)
                back_at = time.monotonic()  # the lost-response check's clock runs from here
                lost = await task
                ended = time.monotonic()
                # A message the scheduler wrote into its dead stream before noticing is lost too: the
                # next request may get the same retryable 503; a retry must then succeed.
                for _ in range(3):
                    after = await h.post("/v1/completions", json={**SHORT, "stream": False, "max_tokens": 4})
                    if after.status_code != 503:
                        break
                    assert "retry the request" in after.json()["error"]["message"]
                return back_at, ended, lost, after

        back_at, ended, lost, after = asyncio.run(go())
        # whichever way it went, the client gets an answer within a few checks: a 503 it can retry
        # on (the check found it ended but unanswered), or the whole answer (a message of it reached
        # the new detokenizer, which told the gateway that none of its text went out: the gateway
        # sent it again)
        if lost.status_code == 503:
            assert "retry the request" in lost.json()["error"]["message"]
        else:
            assert lost.status_code == 200, lost.text
            assert lost.json()["usage"]["completion_tokens"] == SHORT["max_tokens"]
        assert ended - back_at < 20
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop(drain_timeout=2)


def test_sigterm_drains_finishes_short_requests_and_aborts_long_ones_with_a_reason(model_dir):
    # The long request must outlast the drain by far: ~1,950 tokens against a 1 s drain (the tiny model
    # decodes a lone request at several hundred tokens a second here).
    cluster = start_cluster(model_dir, schedulers=1, scheduler_args=["--drain-timeout", "1.0"])
    try:
        sched = cluster.schedulers[0]
        long_body = {**LONG, "max_tokens": 1950}

        async def go():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as h:
                started = [asyncio.Event(), asyncio.Event()]
                tasks = [
                    asyncio.create_task(read_stream(h, b, e))
                    for b, e in zip((long_body, SHORT), started, strict=True)
                ]
                for e in started:
                    await e.wait()
                sched.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(wait_not_admitting, sched)
                refused = await h.post("/v1/completions", json={**SHORT, "stream": False})
                return await asyncio.gather(*tasks), refused

        (long, short), refused = asyncio.run(go())
        assert short["error"] is None and short["finish"] == "length"
        assert long["error"] is not None and "shut down" in long["error"]
        assert refused.status_code == 503
        assert sched.proc.wait(timeout=20) == 0
    finally:
        cluster.stop(drain_timeout=2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_radixserve_serve_starts_prints_the_url_and_stops_on_a_signal(model_dir, signum):

    port, proc = _radixserve_serve(model_dir)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": model_dir.name, "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
        )
        assert r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_a_full_waiting_queue_answers_429_and_the_server_keeps_serving(model_dir):
    cluster = start_cluster(
        model_dir, schedulers=1, scheduler_args=["--max-running-requests", "1", "--max-waiting-requests", "2"]
    )
    try:

        async def flood():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as h:
                body = {**LONG, "stream": False, "max_tokens": 200}
                return await asyncio.gather(*[h.post("/v1/completions", json=body) for _ in range(8)])

        statuses = sorted(r.status_code for r in asyncio.run(flood()))
        assert statuses.count(200) >= 3 and statuses.count(429) >= 1, statuses
        assert set(statuses) <= {200, 429}
        r429 = next(r for r in asyncio.run(flood()) if r.status_code == 429)
        assert (
            r429.json()["error"]["type"] == "rate_limit_error"
            and "waiting" in r429.json()["error"]["message"]
        )
        ok = httpx.post(
            f"{cluster.url}/v1/completions", json={**SHORT, "stream": False, "max_tokens": 3}, timeout=60
        )
        assert ok.status_code == 200
    finally:
        cluster.stop(drain_timeout=2)


def test_the_services_die_with_a_launcher_killed_outright(model_dir):

    port, proc = _radixserve_serve(model_dir)
    try:
        assert f"http://127.0.0.1:{port}/v1" in proc.stdout.readline()  # up: every service started
        # detokenizer, scheduler, gateway, each by its service module's argument; and the zygote
        # that forked them (radixserve.common.zygote), if the launcher used one
        procs = descendants(proc.pid)
        services = [p for p in procs if {"scheduler", "tokenizer", "detokenizer"} & service_names(p)]
        assert len(services) == 3, [service_names(p) for p in procs]
        proc.send_signal(signal.SIGKILL)  # no handler runs: only their death signal stops them
        proc.wait()
        deadline = time.monotonic() + 30
        while left := [p for p in procs if running(p)]:
            assert time.monotonic() < deadline, f"outlived their launcher: {[service_names(p) for p in left]}"
            time.sleep(0.2)
    finally:
        proc.kill()


def _radixserve_serve(model_dir):
    """``radixserve serve`` as a user runs it: (its HTTP port, the process; its stdout is a pipe)."""
    import subprocess
    import sys

    from radixserve.launcher import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    return port, proc


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize(
    ("sig", "timeout"), [(signal.SIGKILL, 20), (signal.SIGSTOP, 5)], ids=["killed", "hung"]
)
def test_a_lost_tensor_parallel_rank_fails_the_stream_and_the_scheduler_exits_nonzero(
    model_dir, sig, timeout
):
    """A killed rank is seen at once (its process handle); a stopped one is alive but silent, so
    only the collective's timeout (--tp-timeout) can tell. Either way: an error, then exit 1."""
    cluster = start_cluster(
        model_dir, schedulers=1, scheduler_args=["--tp-size", "2", "--tp-timeout", str(timeout)]
    )
    try:
        sched = cluster.schedulers[0]
        (follower,) = _children(sched.proc.pid)  # rank 1, started by the scheduler (rank 0)
        metrics = httpx.get(sched.metrics_url).text  # each rank's share, as sized at start
        assert f'radixserve_tp_size{{model_name="{MODEL_NAME}"}} 2.0' in metrics
        weights = [
            float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("radixserve_weight_bytes{")
        ]
        assert len(weights) == 2 and weights[0] == weights[1] > 0
        assert "radixserve_kv_pool_bytes_per_rank" in metrics

        async def go():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as h:
                started = asyncio.Event()
                task = asyncio.create_task(read_stream(h, LONG, started))
                await started.wait()
                os.kill(follower, sig)
                return time.monotonic(), await task

        lost_at, result = asyncio.run(go())
        assert result["error"] is not None, result  # an error, not silence or a clean "length"
        if sig == signal.SIGKILL:
            assert "tensor-parallel rank 1" in result["error"]
        assert result["ended"] - lost_at < timeout + 10
        assert sched.proc.wait(timeout + 20) != 0  # a stopped rank then dies with it (PDEATHSIG)
    finally:
        cluster.stop(drain_timeout=2)
