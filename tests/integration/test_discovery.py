"""``--schedulers discover``: the gateway finds schedulers by their heartbeats in Redis, so
schedulers are added and removed without touching (or restarting) the gateway."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from radixserve.common.ports import free_ports
from radixserve.launcher import Cluster, Service, counter_by
from tests.helpers.cluster import MODEL_NAME, start_cluster
from tests.redis_server import RedisServer


def _schedulers_in_health(cluster: Cluster) -> dict[str, bool]:
    return httpx.get(f"{cluster.url}/health", timeout=5).json()["schedulers"]


def _wait(what: str, check, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _served(s: Service) -> int:
    """Requests scheduler ``s`` has ended (its radixserve_scheduler_requests counter)."""
    return int(
        sum(counter_by(s.metrics_url or "", "radixserve_scheduler_requests", "finish_reason").values())
    )


def _another_scheduler(cluster: Cluster, name: str) -> Service:
    """A scheduler like the cluster's first, on new ports, started now (the gateway is not told)."""
    port, metrics_port = free_ports(2)
    first = cluster.schedulers[0]
    argv = list(first.argv)
    for flag, value in (
        ("--port", str(port)),
        ("--metrics-port", str(metrics_port)),
        ("--advertise-address", f"127.0.0.1:{port}"),
    ):
        argv[argv.index(flag) + 1] = value
    s = Service(
        name,
        argv,
        grpc_address=f"127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        env=dict(first.env),
        tls=first.tls,
    )
    s.start()
    cluster.schedulers.append(s)  # Cluster.stop stops it too
    return s


def _complete(cluster: Cluster, n: int) -> list[int]:
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=cluster.url, timeout=60) as h:
        rs = [h.post("/v1/completions", json={**body, "prompt": f"request {i}"}) for i in range(n)]
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in rs)
    return [r.status_code for r in rs]


def test_schedulers_added_and_removed_are_found_without_restarting_the_gateway(model_dir):
    with RedisServer() as redis:
        cluster = start_cluster(model_dir, schedulers=1, prefix_index=redis.url, discover=True)
        first = cluster.schedulers[0]
        try:
            assert _schedulers_in_health(cluster) == {first.grpc_address: True}
            _complete(cluster, 2)
            gateway_pid = cluster.gateway.proc.pid

            second = _another_scheduler(cluster, "scheduler-1")
            _wait("the new scheduler is healthy", second.healthy, 120)
            found_s = _wait(
                "the gateway found it",
                lambda: (
                    _schedulers_in_health(cluster) == {first.grpc_address: True, second.grpc_address: True}
                ),
            )
            before = _served(second)
            _complete(cluster, 8)  # round-robin over both: half on the new one
            assert _served(second) - before == 4

            first.proc.send_signal(signal.SIGTERM)
            assert first.proc.wait(30) == 0
            gone_s = _wait(
                "the stopped one left /health",
                lambda: _schedulers_in_health(cluster) == {second.grpc_address: True},
            )
            before = _served(second)
            _complete(cluster, 8)  # all on the one left
            assert _served(second) - before == 8
            assert cluster.gateway.proc.pid == gateway_pid and cluster.gateway.alive()
            metrics = httpx.get(f"{cluster.url}/metrics", timeout=5).text
            assert "radixserve_schedulers_healthy 1.0" in metrics
            print(
                f"DISCOVERY found a new scheduler in {found_s:.1f} s, forgot a stopped one in {gone_s:.1f} s"
            )
        finally:
            cluster.stop(drain_timeout=2)


def test_discover_without_a_redis_index_is_refused_at_start_naming_the_settings(model_dir):
    argv = [
        sys.executable,
        "-m",
        "radixserve.tokenizer",
        "--model",
        str(model_dir),
        "--schedulers",
        "discover",
    ]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "--schedulers discover" in last and "--prefix-index" in last and "redis://" in last, p.stderr
    assert "Traceback" not in p.stderr

    p = subprocess.run([*argv, "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "takes no addresses" in p.stderr.strip().splitlines()[-1], p.stderr
