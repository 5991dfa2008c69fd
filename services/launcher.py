"""``radixserve serve``: gateway, N schedulers and a detokenizer as separate processes on loopback.

The embedded default for one machine: the same programs the pods run (``python -m
radixserve.<service>``), wired by flags. Internal gRPC ports are picked free; the HTTP port is
``--port``. Ready when every service reports healthy and the gateway is connected to every
scheduler. ``Cluster.supervise`` restarts a service that exits (``RestartPolicy``: backoff after fast
crashes, giving up after several in a row) while the others keep serving. Ctrl-C / SIGTERM stops the
gateway and the schedulers together (no new requests anywhere; running ones finish within the
schedulers' drain timeout and reach their clients, or end with an error that says why), then the
detokenizer.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from radixserve.common import zygote
from radixserve.common.config import ConfigError, RaisingParser, load, parse_args, service_parser
from radixserve.common.health import is_serving
from radixserve.common.ports import check_listen, free_ports
from radixserve.common.ports import free_port as free_port  # re-exported: tests and benchmarks
from radixserve.common.service_config import DetokenizerConfig, GatewayConfig, SchedulerPodConfig
from radixserve.common.tls import TLS, tls_from_env
from radixserve.common.zygote import ChildProcess

ServiceConfig = SchedulerPodConfig | GatewayConfig | DetokenizerConfig
# Each service module's config, and whether it takes --served-model-name: a service's command line
# is checked with the parser the module itself builds (``Cluster.check``).
SERVICE_CONFIGS: dict[str, tuple[type[ServiceConfig], bool]] = {
    "radixserve.scheduler": (SchedulerPodConfig, True),
    "radixserve.tokenizer": (GatewayConfig, True),
    "radixserve.detokenizer": (DetokenizerConfig, False),
}
TAIL_BYTES = 8192  # of a service's stderr, kept to say why it exited
REASON_CHARS = 400  # of the reason quoted from it

# A service's own words about why it stops: its log's last ERROR record (the services' format, or
# uvicorn's), else an uncaught exception's message (a traceback's last lines); either may span lines.
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ [A-Z]+ |^[A-Z]+: +")
_ERROR_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ (?:ERROR|CRITICAL) |^ERROR: +")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Failure)\b")


def stated_reason(stderr: str) -> str | None:
    """A process's own last words about why it stops, as one line: its last ERROR record or
    exception message with the lines that continue it, else its last line; None if it said nothing."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    if not lines:
        return None
    start = len(lines) - 1
    for i in reversed(range(len(lines))):
        if _ERROR_LOG.match(lines[i]) or _EXCEPTION.match(lines[i]):
            start = i
            break
    rest = itertools.takewhile(lambda x: not _LOG_RECORD.match(x), lines[start + 1 :])
    why = " ".join(" ".join([_ERROR_LOG.sub("", lines[start]), *rest]).split())
    why = why.removesuffix("; exiting with status 1")
    return why if len(why) <= REASON_CHARS else why[: REASON_CHARS - 3] + "..."


class StartFailed(RuntimeError):
    """A service exited, or not all were ready in time, while ``Cluster.start`` waited: the message
    is one line naming the service and its own reason."""


@dataclass
class Service:
    name: str
    argv: list[str]
    grpc_address: str | None = None  # checked with grpc.health.v1
    tls: TLS | None = None  # of that check: the services' own (RADIXSERVE_TLS_*)
    http_url: str | None = None  # checked with GET /health
    metrics_url: str | None = None  # Prometheus /metrics
    env: dict[str, str] = field(default_factory=dict)
    proc: ChildProcess | None = None
    started_at: float = 0.0
    restarts: int = 0
    fast_crashes: int = 0  # exits in a row, each soon after its start
    restart_at: float | None = None  # exited; to be started again then
    tail: bytearray = field(default_factory=bytearray)  # the end of its stderr since its last start
    started: list[ChildProcess] = field(default_factory=list)  # every process, restarts too

    def start(self) -> None:
        self.started_at = time.monotonic()
        # Children must not outlive a launcher that is killed outright (SIGKILL runs no handlers):
        # radixserve.common.child sets their death signal before it runs the service.
        env = {**os.environ, **self.env, "RADIXSERVE_PARENT_PID": str(os.getpid())}
        self.tail = bytearray()
        # Its own session: Ctrl-C reaches the launcher only, which stops the children in order.
        # Its stderr is passed on as it comes (``_relay``); its end says why it exited.
        self.proc = zygote.spawn(self.argv, env, stderr_pipe=True, zygote=zygote.shared())
        self.started.append(self.proc)
        assert self.proc.stderr is not None
        threading.Thread(
            target=_relay, args=(self.proc.stderr, self.tail), name=f"{self.name}-stderr", daemon=True
        ).start()

    def last_error(self) -> str | None:
        """Why it stopped, in its own words (``stated_reason`` of its stderr's end)."""
        return stated_reason(self.tail.decode(errors="replace"))

    def exit_reason(self, when: str) -> str:
        """``NAME exited WHEN with code N``, and its own last error line if it said one."""
        code = self.proc.returncode if self.proc is not None else None
        why = self.last_error()
        return f"{self.name} exited {when} with code {code}" + (f": {why}" if why else "")

    def checked_config(self) -> ServiceConfig:
        """Its config from its command line (and the environment it inherits), checked as the
        service checks it at its start; ConfigError names the service and the setting."""
        cls, named = SERVICE_CONFIGS[self.argv[0]]
        parser = service_parser(cls, self.name, served_name=named, parser_class=RaisingParser)
        try:
            return load(cls, parse_args(parser, self.argv[1:]))
        except ConfigError as e:
            raise ConfigError(f"{self.name}: {e}") from None

    def healthy(self) -> bool:
        if self.grpc_address:
            return is_serving(self.grpc_address, timeout=0.5, tls=self.tls)
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
            _kill_group(self.proc)

    def reap(self) -> None:
        """Every process this service ever started is gone and waited for: one still running (a
        stop that did not end it) is killed with its process group (a scheduler's tensor-parallel
        ranks)."""
        for p in self.started:
            if p.poll() is None:
                _kill_group(p)


def _kill_group(p: ChildProcess) -> None:
    # Each child leads its own session (start_new_session): its group is it and what it started.
    zygote.kill_group(p)
    p.wait()


@dataclass
class Cluster:
    gateway: Service
    schedulers: list[Service]
    detokenizers: list[Service]
    url: str
    grpc_address: str

    @property
    def detokenizer(self) -> Service:
        """The first detokenizer (with one, the detokenizer)."""
        return self.detokenizers[0]

    @property
    def services(self) -> list[Service]:
        return [*self.detokenizers, *self.schedulers, self.gateway]

    supervisor: Supervisor | None = None

    def check(self) -> None:
        """ConfigError naming the first service whose command line cannot work or that could not
        listen on its ports: what would fail its start, found before anything starts."""
        for s in self.services:
            cfg = s.checked_config()
            try:
                check_listen(cfg.host, cfg.listens())
            except ConfigError as e:
                raise ConfigError(f"{s.name}: {e}") from None

    def start(self, timeout: float = 300.0) -> None:
        """Starts every service and waits until all are ready; StartFailed (the others stopped)
        when one exits meanwhile, naming it and its own reason, or when ``timeout`` passes."""
        for svc in self.services:
            svc.start()
        deadline = time.monotonic() + timeout
        pending: list[Service | str] = [*self.services, "routes"]
        while pending:
            for s in list(pending):
                if isinstance(s, str):  # last: the gateway sees every scheduler, so each gets traffic
                    if len(pending) == 1 and self.gateway_connected() == len(self.schedulers):
                        pending.remove(s)
                    continue
                if not s.alive():
                    self.stop()
                    raise StartFailed(s.exit_reason("during start"))
                if s.healthy():
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                self.stop()
                names = ", ".join(s if isinstance(s, str) else s.name for s in pending)
                raise StartFailed(f"not ready after {timeout:.0f} s: {names}")
            time.sleep(0.2)

    def gateway_connected(self) -> int:
        """Schedulers the gateway has a live Watch stream to (what it routes to)."""
        try:
            up = httpx.get(f"{self.url}/health", timeout=2).json().get("schedulers", {})
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(bool(v) for v in up.values())

    def requests_served(self) -> list[int]:
        """Requests each scheduler has ended, any finish reason (its ``radixserve_scheduler_requests``
        counter; a restarted scheduler counts from zero)."""
        family, label = "radixserve_scheduler_requests", "finish_reason"
        return [int(sum(counter_by(s.metrics_url or "", family, label).values())) for s in self.schedulers]

    def supervise(
        self, policy: RestartPolicy | None = None, say: Callable[[str], None] | None = None
    ) -> Supervisor:
        """Restart services that exit, from a background thread, until ``stop``."""
        self.supervisor = Supervisor(self, policy or RestartPolicy(), say or _say)
        self.supervisor.start()
        return self.supervisor

    def stop(self, drain_timeout: float = 10.0) -> None:
        """``drain_timeout``: how long to wait for schedulers beyond their own drain timeout."""
        if self.supervisor is not None:
            self.supervisor.pause()
        for s in [self.gateway, *self.schedulers]:  # in parallel: each drains on its own
            if s.alive() and s.proc is not None:
                s.proc.send_signal(signal.SIGTERM)
        for s in self.schedulers:
            s.stop(drain_timeout + 10)
        self.gateway.stop(10)
        for d in self.detokenizers:
            d.stop(10)
        if self.supervisor is not None:
            self.supervisor.stop()
        for s in self.services:  # restarted ones' earlier processes included
            s.reap()


def counter_by(url: str, family: str, *labels: str) -> dict[str, float]:
    """A Prometheus counter's totals at ``url`` (a /metrics endpoint) by its ``labels``' values,
    joined with ``/`` when there are several."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return {
        "/".join(x.labels[label] for label in labels): x.value
        for f in text_string_to_metric_families(text)
        if f.name == family
        for x in f.samples
        if x.name.endswith("_total")
    }


def _say(line: str) -> None:
    print(f"radixserve: {line}", file=sys.stderr, flush=True)


def _relay(pipe: typing.IO[bytes], tail: bytearray) -> None:
    """Copies a child's stderr to ours as it comes, keeping its last ``TAIL_BYTES`` in ``tail``.
    Reads on when ours cannot be written: a child must never block on a full pipe."""
    fd = pipe.fileno()
    try:
        while chunk := os.read(fd, 65536):
            tail += chunk
            del tail[:-TAIL_BYTES]
            with contextlib.suppress(OSError):
                _write_all(2, chunk)
    finally:
        pipe.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@dataclass(frozen=True)
class RestartPolicy:
    """When a service exits, it is started again: at once if it had run ``fast_crash_s`` or more,
    else after ``backoff_s`` doubling with each such fast crash in a row (up to ``max_backoff_s``);
    ``max_fast_crashes`` in a row means it cannot run here, and supervision gives up."""

    backoff_s: float = 1.0
    max_backoff_s: float = 16.0
    fast_crash_s: float = 30.0
    max_fast_crashes: int = 5


class Supervisor:
    """Keeps a cluster's processes running, as Kubernetes' restart policy does for the pods: the
    others keep serving meanwhile (the gateway routes around a scheduler that is down, schedulers
    reconnect to a restarted detokenizer, the detokenizer to a restarted gateway)."""

    def __init__(self, cluster: Cluster, policy: RestartPolicy, say: Callable[[str], None]) -> None:
        self.cluster, self.policy, self.say = cluster, policy, say
        self.gave_up: str | None = None  # why supervision ended, if it did on its own
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def poll(self, now: float | None = None) -> str | None:
        """One look at every service: restart what is due; returns why it gives up, if it does."""
        with self._lock:  # not while ``pause`` waits: no restart after the stop began
            if self._paused.is_set():
                return None
            return self._poll(time.monotonic() if now is None else now)

    def _poll(self, now: float) -> str | None:
        p = self.policy
        for s in self.cluster.services:
            if s.alive():
                if s.fast_crashes and now - s.started_at >= p.fast_crash_s:
                    s.fast_crashes = 0  # it runs now
                continue
            if s.restart_at is None:  # just found exited
                code = s.proc.returncode if s.proc is not None else None
                ran = now - s.started_at
                s.fast_crashes = s.fast_crashes + 1 if ran < p.fast_crash_s else 0
                if s.fast_crashes >= p.max_fast_crashes:
                    why = s.last_error()
                    return (
                        f"{s.name} exited (code {code}) {s.fast_crashes} times in a row, each within"
                        f" {p.fast_crash_s:.0f} s of its start; giving up"
                        + (f" (its last error: {why})" if why else " (its log above says why)")
                    )
                delay = (
                    0.0
                    if s.fast_crashes == 0
                    else min(p.max_backoff_s, p.backoff_s * 2 ** (s.fast_crashes - 1))
                )
                self.say(
                    f"{s.name} exited with code {code} after {ran:.1f} s; restarting it in {delay:.1f} s"
                )
                s.restart_at = now + delay
            elif now >= s.restart_at:
                s.restart_at = None
                s.restarts += 1
                s.start()
        return None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # The thread lives until ``stop``, after the services: PR_SET_PDEATHSIG fires when the
        # thread that started a child ends, and a restarted one must not go before the others.
        while not self._stop.wait(0.2):
            if self.gave_up is None and not self._paused.is_set():
                try:
                    why = self.poll()
                except Exception as e:  # e.g. no process could be started (EAGAIN, EMFILE)
                    why = f"supervision failed: {type(e).__name__}: {e}"
                if why is not None:
                    self.gave_up = why
                    self.say(why)

    def pause(self) -> None:
        """No more restarts (the services are being stopped); waits for a restart under way."""
        with self._lock:
            self._paused.set()

    def stop(self) -> None:
        self._paused.set()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


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
    tp_size: int = 1,
    drain_timeout: float = 5.0,
    prefix_index: str = "memory",
    env: dict[str, str] | None = None,
    detokenizers: int = 1,
) -> Cluster:
    """The services' command lines; ``scheduler_args`` come last, so they override the defaults here.
    Nothing starts: ``Cluster.check`` says whether they can, ``Cluster.start`` starts them."""
    if min(schedulers, tp_size, detokenizers) < 1:
        raise ValueError(
            f"schedulers ({schedulers}), detokenizers ({detokenizers}) and tp_size ({tp_size}) must be"
            " at least 1"
        )
    ports = iter([p for p in free_ports(2 + 2 * (schedulers + detokenizers)) if p not in (port, grpc_port)])
    detoks = [_detokenizer(i, detokenizers, model, next(ports), next(ports)) for i in range(detokenizers)]
    if torch_threads is None:  # share the cores: one left for the gateway and the detokenizer
        torch_threads = max(1, ((os.cpu_count() or 2) - 1) // (schedulers * tp_size))
    common = ["--torch-threads", str(torch_threads), "--drain-timeout", str(drain_timeout)]
    common += ["--tp-size", str(tp_size)] if tp_size > 1 else []
    if prefix_index != "memory":  # Redis: the pods publish there themselves
        common += ["--prefix-index", prefix_index]
    scheds = [
        _scheduler(i, model, model_name, next(ports), next(ports), detoks, [*common, *scheduler_args])
        for i in range(schedulers)
    ]
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
    tls = tls_from_env({**os.environ, **(env or {})})  # TLS gRPC: probed with the services' settings
    for svc in (*detoks, *scheds, gateway):
        svc.env = dict(env or {})  # e.g. OTEL_EXPORTER_OTLP_ENDPOINT: each names itself radixserve-<kind>
        svc.tls = tls
    return Cluster(gateway, scheds, detoks, f"http://{url_host}:{port}", f"{url_host}:{gport}")


def _detokenizer(i: int, n: int, model: Path, port: int, metrics_port: int) -> Service:
    argv = ["radixserve.detokenizer", "--model", str(model), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port)]
    return Service(
        "detokenizer" if n == 1 else f"detokenizer-{i}",
        argv,
        grpc_address=f"127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
    )


def _scheduler(
    i: int,
    model: Path,
    model_name: str,
    port: int,
    metrics_port: int,
    detoks: list[Service],
    extra: list[str],
) -> Service:
    # Each scheduler starts on its own detokenizer (the next ones are its fallbacks): they share the load.
    k = i % len(detoks)
    detok = ",".join(d.grpc_address or "" for d in [*detoks[k:], *detoks[:k]])
    argv = ["radixserve.scheduler", "--model", str(model), "--served-model-name", model_name]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
    argv += ["--advertise-address", f"127.0.0.1:{port}", "--detokenizer", detok]
    return Service(
        f"scheduler-{i}",
        [*argv, *extra],
        grpc_address=f"127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
    )
