"""``radixserve serve``: gateway, N schedulers and a detokenizer as separate processes on loopback.

The embedded default for one machine: the same programs the pods run (``python -m
radixserve.<service>``), wired by flags. Internal gRPC ports are picked free; the HTTP port is
``--port``. Ready when every service reports healthy. Ctrl-C / SIGTERM stops the gateway and the
schedulers together (no new requests anywhere; running ones finish within the schedulers' drain
timeout and reach their clients, or end with an error that says why), then the detokenizer.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from radixserve.common.rpc import is_serving


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all held open at once, so the kernel cannot hand one out twice."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """Children must not outlive a launcher that is killed outright (SIGKILL runs no handlers)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Service:
    name: str
    argv: list[str]
    grpc_address: str | None = None  # checked with grpc.health.v1
    http_url: str | None = None  # checked with GET /health
    metrics_url: str | None = None  # Prometheus /metrics
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *self.argv],
            env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops the children in order
            preexec_fn=_die_with_parent,
        )

    def healthy(self) -> bool:
        if self.grpc_address:
            return is_serving(self.grpc_address, timeout=0.5)
        try:
            return httpx.get(f"{self.http_url}/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Cluster:
    gateway: Service
    schedulers: list[Service]
    detokenizer: Service
    url: str
    grpc_address: str

    @property
    def services(self) -> list[Service]:
        return [self.detokenizer, *self.schedulers, self.gateway]

    def start(self, timeout: float = 300.0) -> None:
        for s in self.services:
            s.start()
        deadline = time.monotonic() + timeout
        pending = list(self.services)
        while pending:
            for s in list(pending):
                if not s.alive():
                    self.stop()
                    raise RuntimeError(
                        f"{s.name} exited with {s.proc.returncode if s.proc else '?'} during start"
                    )
                if s.healthy():
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"not healthy after {timeout:.0f} s: {[s.name for s in pending]}")
            time.sleep(0.2)

    def stop(self, drain_timeout: float = 10.0) -> None:
        """``drain_timeout``: how long to wait for schedulers beyond their own drain timeout."""
        for s in [self.gateway, *self.schedulers]:  # in parallel: each drains on its own
            if s.alive() and s.proc is not None:
                s.proc.send_signal(signal.SIGTERM)
        for s in self.schedulers:
            s.stop(drain_timeout + 10)
        self.gateway.stop(10)
        self.detokenizer.stop(10)


def build_cluster(
    model: Path,
    model_name: str,
    port: int = 8000,
    host: str = "127.0.0.1",
    grpc_port: int | None = None,
    schedulers: int = 1,
    scheduler_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    torch_threads: int | None = None,
    drain_timeout: float = 5.0,
    prefix_index: str = "memory",
    env: dict[str, str] | None = None,
) -> Cluster:
    """The services' command lines; ``scheduler_args`` come last, so they override the defaults here."""
    ports = iter([p for p in free_ports(4 + 2 * schedulers) if p != port])
    detok_port, detok_metrics = next(ports), next(ports)
    detok = Service(
        "detokenizer",
        [
            "radixserve.detokenizer",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(detok_port),
            "--metrics-port",
            str(detok_metrics),
        ],
        grpc_address=f"127.0.0.1:{detok_port}",
        metrics_url=f"http://127.0.0.1:{detok_metrics}/metrics",
    )
    if torch_threads is None:  # share the cores: one left for the gateway and the detokenizer
        torch_threads = max(1, ((os.cpu_count() or 2) - 1) // schedulers)
    scheds = []
    for i in range(schedulers):
        p, mp = next(ports), next(ports)
        argv = ["radixserve.scheduler", "--model", str(model), "--served-model-name", model_name]
        argv += ["--host", "127.0.0.1", "--port", str(p), "--metrics-port", str(mp)]
        if prefix_index != "memory":  # Redis: the pods publish there themselves
            argv += ["--prefix-index", prefix_index]
        argv += ["--advertise-address", f"127.0.0.1:{p}", "--detokenizer", f"127.0.0.1:{detok_port}"]
        argv += [
            "--torch-threads",
            str(torch_threads),
            "--drain-timeout",
            str(drain_timeout),
            *scheduler_args,
        ]
        scheds.append(
            Service(
                f"scheduler-{i}",
                argv,
                grpc_address=f"127.0.0.1:{p}",
                metrics_url=f"http://127.0.0.1:{mp}/metrics",
            )
        )
    gport = grpc_port or next(ports)
    argv = ["radixserve.tokenizer", "--model", str(model), "--served-model-name", model_name]
    argv += ["--host", host, "--port", str(port), "--grpc-port", str(gport)]
    argv += [
        "--advertise-address",
        f"127.0.0.1:{gport}",
        "--schedulers",
        *[s.grpc_address or "" for s in scheds],
    ]
    argv += ["--drain-timeout", str(drain_timeout + 2), "--prefix-index", prefix_index, *gateway_args]
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    gateway = Service(
        "gateway", argv, http_url=f"http://{url_host}:{port}", metrics_url=f"http://{url_host}:{port}/metrics"
    )
    for svc in (detok, *scheds, gateway):
        svc.env = dict(env or {})  # e.g. OTEL_EXPORTER_OTLP_ENDPOINT: each names itself radixserve-<kind>
    return Cluster(gateway, scheds, detok, f"http://{url_host}:{port}", f"{url_host}:{gport}")
