"""One configuration on a fresh cluster: start it, drive the workload through its gateway, watch
where the requests went, replay its routing decisions, and stop it in the background."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as common

from . import client
from .analysis import public_record, summarize
from .cluster import RedisServer, check_alive, gateway_decisions, start_cluster, teardown
from .cpu import CpuMeter
from .decisions import replay_decisions
from .monitor import Attribution, PodMonitor
from .settings import BLOCK_SIZE, POLICY


@dataclass
class Traffic:
    """What one configuration's traffic left: the requests' records, the pods' Watch streams, and
    the timings, CPU seconds and gateway decisions around it."""

    records: list[dict]
    monitor: PodMonitor
    times: dict[str, float]  # warm_s, cpu_window_s, traffic_wall_s
    cpu_s: dict[str, float]
    live_reasons: dict[str, int]  # the gateway's decisions during the traffic, by reason
    loadavg_1m_before_after: list[float]


async def _send(
    cluster: Any,
    wl: dict,
    addresses: list[str],
    attribution: Attribution,
    cpu: CpuMeter,
    args: argparse.Namespace,
) -> Traffic:
    """Warm every pod, then send the workload with the pods watched and the CPU metered."""
    times: dict[str, float] = {}
    t = time.perf_counter()
    await client.warm(cluster.url, 2 * args.schedulers, args.vocab_size)
    times["warm_s"] = time.perf_counter() - t
    monitor = PodMonitor(addresses, attribution)
    start = time.perf_counter() + 0.3  # the Watch snapshots arrive; every task is sleeping
    monitor.start(start)
    cpu_before = cpu.read()
    decisions_before = await asyncio.to_thread(gateway_decisions, cluster.url)
    records = await client.run_requests(cluster.url, wl["requests"], start)
    cpu_used = CpuMeter.used(cpu_before, cpu.read())
    after = await asyncio.to_thread(gateway_decisions, cluster.url)
    live_reasons = {k: int(v - decisions_before.get(k, 0)) for k, v in after.items()}
    times["cpu_window_s"] = time.perf_counter() - start
    await asyncio.sleep(0.5)  # the last block events
    monitor.stop()
    times["traffic_wall_s"] = time.perf_counter() - start
    return Traffic(records, monitor, times, cpu_used, live_reasons, [])


def where_requests_went(traffic: Traffic, wl: dict, attribution: Attribution, summary: dict) -> dict:
    """The routing section of a result: each request's pod (set on its record too) and the pods'
    view of tenants, prefixes and load, with the gateway's own decisions."""
    records, monitor = traffic.records, traffic.monitor
    for i, rec in enumerate(records):
        rec["pod"] = monitor.pod_of_request.get(i)
    routing = monitor.summary(wl, summary["makespan_s"], [r["cached_tokens"] for r in records])
    routing["unattributable_requests"] = attribution.unattributable
    routing["live_decision_reasons"] = traffic.live_reasons
    return routing


def _print_progress(label: str, name: str, result: dict, traffic: Traffic, elapsed_s: float) -> None:
    s, decision, routing = result["summary"], result["decision"], result["routing"]
    print(
        f"  {label}{name}: {s['completed']}/{len(traffic.records)} ok, hit rate {s['hit_rate']:.3f},"
        f" {s['output_tok_s']:.1f} out tok/s, TTFT p90 {s['ttft_ms_p90']:.0f} ms,"
        + (f" decision p99 {decision['decision_ms_p99']:.3f} ms," if decision else "")
        + f" requests per pod {routing['requests_per_pod']}, prefix prefills {routing['prefix_prefills']},"
        f" decisions {traffic.live_reasons}"
        f" ({elapsed_s:.0f} s); CPU s over {traffic.times['cpu_window_s']:.1f} s: {traffic.cpu_s}",
        flush=True,
    )


def run_config(
    name: str,
    model: Path,
    wl: dict,
    eargs: dict,
    args: argparse.Namespace,
    previous: threading.Thread | None = None,
    label: str = "",
    time_routing: bool = True,
) -> tuple[dict, threading.Thread]:
    """One configuration on a fresh cluster. Returns its results and the thread stopping its cluster
    (and Redis): the next configuration starts its own meanwhile and waits for that thread before
    sending any traffic (``previous``), so no two clusters are ever up during a measurement.
    ``time_routing``: replay the decisions for their latency (off for the saturation repeats)."""
    policy = POLICY[name]
    t_cfg = time.perf_counter()
    redis_srv = RedisServer(args.redis_server) if name.endswith("+redis") else None
    try:
        cluster = start_cluster(name, policy, model, eargs, args, redis_srv)
    except BaseException:
        if redis_srv is not None:
            redis_srv.stop()
        raise
    stopper = threading.Thread(target=teardown, args=(cluster, redis_srv), name=f"stop-{name}")
    try:
        started_s = time.perf_counter() - t_cfg
        if previous is not None:
            previous.join()
        addresses = [s.grpc_address or "" for s in cluster.schedulers]
        attribution = Attribution(wl, BLOCK_SIZE)
        cpu = CpuMeter(cluster, redis_srv)
        with common.Meter() as meter:
            traffic = asyncio.run(_send(cluster, wl, addresses, attribution, cpu, args))
        traffic.loadavg_1m_before_after = meter.loadavg_before_after()
        check_alive(cluster, "after the traffic")
        summary = summarize(traffic.records)
        routing = where_requests_went(traffic, wl, attribution, summary)
        t = time.perf_counter()
        decision: dict[str, Any] = {}
        if time_routing:
            redis_url = redis_srv.url if redis_srv is not None else None
            decision = replay_decisions(
                policy, redis_url, traffic.monitor, addresses, wl["requests"], args.decision_passes
            )
        traffic.times["decision_replay_s"] = time.perf_counter() - t
    finally:
        stopper.start()
    result = {
        "policy": policy,
        "prefix_index": "redis" if redis_srv else "memory",
        "scheduler_addresses": addresses,
        "summary": summary,
        "routing": routing,
        "decision": decision,
        "cluster_start_s": started_s,
        **traffic.times,
        "loadavg_1m_before_after": traffic.loadavg_1m_before_after,
        # CPU seconds per process from just before the first request to the last response
        # (cpu_window_s; the client's count includes its monitor's polling)
        "cpu_s": traffic.cpu_s,
        "requests": [public_record(r) for r in traffic.records],
    }
    _print_progress(label, name, result, traffic, time.perf_counter() - t_cfg)
    return result, stopper
