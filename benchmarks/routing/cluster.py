"""The processes a configuration runs on: a fresh cluster (gateway, scheduler pods, detokenizer),
a Redis server for the Redis prefix index, and the checks and metrics read from them."""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from typing import Any

import _common as common


class RedisServer:
    """A foreground ``redis-server`` child on a free port, nothing persisted; stopped by its pid."""

    def __init__(self, binary: str) -> None:
        from radixserve.launcher import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        import redis

        r = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 15
        while True:
            try:
                if r.ping():
                    break
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not come up")
            time.sleep(0.05)
        r.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------------- runs
def gateway_decisions(url: str) -> dict[str, float]:
    """The gateway's own count of its routing decisions by reason (its /metrics)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("radixserve_router_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


def _ports(cluster: Any) -> list[str]:
    """Every port the cluster's command lines name (--port, --grpc-port, --metrics-port, ...)."""
    out = []
    for svc in cluster.services:
        for flag, value in zip(svc.argv, svc.argv[1:], strict=False):
            if flag.startswith("--") and flag.endswith("port"):
                out.append(value)
    return out


def check_alive(cluster: Any, when: str) -> None:
    """Every process still runs and every scheduler has its own address (a scheduler that could not
    bind its port would otherwise pass the launcher's health check through another one's)."""
    dead = [s.name for s in cluster.services if not s.alive()]
    addresses = [s.grpc_address for s in cluster.schedulers]
    if dead or len(set(addresses)) != len(addresses):
        raise RuntimeError(f"cluster broken {when}: exited {dead}, scheduler addresses {addresses}")


def teardown(cluster: Any, redis_srv: RedisServer | None) -> None:
    try:
        cluster.stop(drain_timeout=5)
    finally:
        if redis_srv is not None:
            redis_srv.stop()


def _fresh_cluster(
    name: str, policy: str, model: Path, eargs: dict, args: argparse.Namespace, redis_srv: RedisServer | None
) -> Any:
    """A cluster (not started) whose services all have ports of their own."""
    from radixserve.launcher import build_cluster, free_port

    for _ in range(20):  # launcher.free_port can hand out one port twice: draw again
        c = build_cluster(
            model,
            common.MODEL_NAME,
            port=free_port(),
            schedulers=args.schedulers,
            scheduler_args=common.scheduler_flags(eargs),
            gateway_args=["--router", policy],
            torch_threads=args.threads,
            drain_timeout=5.0,
            prefix_index=redis_srv.url if redis_srv else "memory",
        )
        ports = _ports(c)
        if len(set(ports)) == len(ports):
            break
        print(f"  {name}: the launcher drew a port twice ({sorted(ports)}); drawing again", flush=True)
    return c


def start_cluster(
    name: str, policy: str, model: Path, eargs: dict, args: argparse.Namespace, redis_srv: RedisServer | None
) -> Any:
    """A started cluster for configuration ``name``, every process alive; raises (its cluster
    stopped) if three in a row fail to start."""
    cluster = _fresh_cluster(name, policy, model, eargs, args, redis_srv)
    for attempt in range(3):  # a port taken by someone else between the draw and the bind
        try:
            cluster.start(timeout=300)
            check_alive(cluster, "after start")
            break
        except RuntimeError as e:
            cluster.stop(drain_timeout=1)
            if attempt == 2:
                raise
            print(f"  {name}: {e}; starting a fresh cluster", flush=True)
            cluster = _fresh_cluster(name, policy, model, eargs, args, redis_srv)
    return cluster
