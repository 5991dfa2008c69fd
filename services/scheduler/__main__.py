"""python -m radixserve.scheduler: one scheduler pod (engine + gRPC server).

    python -m radixserve.scheduler --model PATH|demo --port 50051 --detokenizer HOST:PORT [engine flags]

Every engine argument of ``radixserve.Engine`` is a flag (``--page-size 16``, ``--disable-overlap``,
...), and every flag can come from ``RADIXSERVE_<FLAG>`` (``RADIXSERVE_PAGE_SIZE=16``); see --help.
SIGTERM / Ctrl-C: stop admitting (health NOT_SERVING), let running requests finish for up to
--drain-timeout seconds, abort the rest with a reason the client sees, exit 0.

Health (grpc.health.v1): "" is readiness (NOT_SERVING once draining); "liveness" turns NOT_SERVING
while the engine has had work and finished no step for --stall-timeout seconds (a hung engine; the
log names where the engine thread is stuck), and SERVING again if it steps again.

Failure: a bad flag or variable (named, with its range), a model folder that is none, a port in
use, an engine that cannot start (e.g. a model whose heads do not divide by --tp-size), an engine
loop that fails, or a tensor-parallel rank that dies: one log line with the reason (also written to
/dev/termination-log, which Kubernetes shows in the pod's status), requests in flight end with a
retryable error, exit 1. The first three are found before torch is imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixserve.common.config import (
    ConfigError,
    OneLineParser,
    RaisingParser,
    load_format_problem,
    load_service,
    model_path,
    resolve_model,
    served_model_name,
    service_parser,
)
from radixserve.common.ports import check_listen
from radixserve.common.process_exit import exit_now
from radixserve.common.service_config import SchedulerPodConfig
from radixserve.common.stop_signal import StopSignal

if TYPE_CHECKING:  # imported when the engine starts (torch is slow to import; --help is not)
    from radixserve.scheduler.server import RedisTarget


def build_parser(parser_class: type[argparse.ArgumentParser] = OneLineParser) -> argparse.ArgumentParser:
    prog = "python -m radixserve.scheduler"
    return service_parser(SchedulerPodConfig, prog, __doc__, served_name=True, parser_class=parser_class)


def load_settings(argv: Sequence[str] | None) -> tuple[argparse.Namespace, SchedulerPodConfig]:
    """The flags and settings, checked against the model folder and the ports; ConfigError naming
    the first that cannot work."""
    args, cfg = load_service(build_parser(RaisingParser), SchedulerPodConfig, argv, weights=True)
    problem = load_format_problem(model_path(args.model), cfg.engine.load_format)
    if problem is not None:
        raise ConfigError(problem)
    check_listen(cfg.host, cfg.listens())  # a port in use: one line, not gRPC's bind error
    return args, cfg


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    stop = StopSignal(exit_until_ready=True).install()  # until the engine is up, a signal ends it
    try:  # every setting, the model folder and the ports, before torch is imported and the model loads
        args, cfg = load_settings(argv)
    except ConfigError as e:
        return _failed(str(e))
    import torch

    from radixserve.common import telemetry
    from radixserve.common.tls import TLSError, load_tls
    from radixserve.scheduler import compiled_artefacts, startup
    from radixserve.scheduler.engine import Engine
    from radixserve.scheduler.server import fail, serve, shutdown
    from radixserve.scheduler.startup import process_age_s
    from radixserve.scheduler.tensor_parallel import TPFailure

    try:
        tls = load_tls(cfg.tls)  # before the engine: a wrong file fails the pod at once
    except TLSError as e:
        return _failed(f"TLS settings: {e}")
    telemetry.setup_tracing("radixserve-scheduler")
    if cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)
    started = process_age_s()  # exec to here: the interpreter, imports, settings
    compiled = compiled_artefacts.Snapshot.take()  # what the compile caches hold before the engine
    t_fetch = time.perf_counter()
    folder = resolve_model(args.model)
    fetched = time.perf_counter() - t_fetch
    try:
        engine = Engine(folder, cfg.engine)
    except (ValueError, TPFailure) as e:  # a setting the model or the devices cannot meet
        return _failed(f"cannot start the engine: {e}")
    stop.ready()  # from here a stop drains
    failures: list[str] = []

    def on_failure(reason: str) -> None:
        failures.append(reason)
        stop.set()

    address = cfg.advertise_address or f"localhost:{cfg.port}"
    server, service, health = serve(
        engine,
        f"{cfg.host}:{cfg.port}",
        cfg.detokenizer,
        address,
        model_name=served_model_name(args),
        block_size=cfg.block_size,
        tls=tls,
        stall_timeout_s=cfg.stall_timeout,
        on_failure=on_failure,
        publish_to=redis_target(cfg),
    )
    if cfg.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port, addr=cfg.host, registry=service.metrics.registry)
    if engine.followers is not None:
        engine.followers.watch(on_failure)
    phases = {"process_start": started, "model_fetch": fetched, **engine.startup}
    startup.report(phases, service.metrics.registry, service.model_name)
    compiled.report()
    logging.info("serving on %s:%d (KV %d tokens)", cfg.host, cfg.port, engine.scheduler.kv.capacity)
    while not stop.wait(1.0):
        pass
    if failures:
        _failed(f"scheduler failed: {failures[0]}")
        fail(server, service, health, failures[0], cfg.engine.tp_timeout + 5)
        telemetry.shutdown()
        return 1
    logging.info("shutting down (drain up to %.0f s)", cfg.drain_timeout)
    # Stop admitting before leaving Redis: deregistering takes a round trip or two, and a request
    # admitted meanwhile would only lengthen the drain (Submit answers UNAVAILABLE: retried elsewhere).
    service.worker.stop_admitting()
    service.stop_publishing()
    shutdown(server, service, health, cfg.drain_timeout)
    telemetry.shutdown()
    return 0


def redis_target(cfg: SchedulerPodConfig) -> RedisTarget | None:
    """Where the pod publishes its block events and heartbeats, when it does (--prefix-index)."""
    from radixserve.scheduler.server import RedisTarget

    if not cfg.prefix_index:
        return None
    return RedisTarget(cfg.prefix_index, cfg.index_key_prefix, cfg.heartbeat_interval, cfg.heartbeat_ttl)


def _failed(reason: str) -> int:
    """Say why the scheduler stops, in its log and where Kubernetes reads a container's last words:
    one line (a library's message may span several)."""
    reason = " ".join(reason.split())
    logging.error("%s; exiting with status 1", reason)
    if os.path.exists("/dev/termination-log"):
        try:
            with open("/dev/termination-log", "w") as f:
                f.write(reason[-4000:])
        except OSError:
            pass
    return 1


if __name__ == "__main__":
    exit_now(main())
