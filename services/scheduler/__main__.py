"""python -m radixserve.scheduler: one scheduler pod (engine + gRPC server).

    python -m radixserve.scheduler --model PATH|demo --port 50051 --detokenizer HOST:PORT [engine flags]

Every engine argument of ``radixserve.Engine`` is a flag (``--page-size 16``, ``--disable-overlap``,
...), and every flag can come from ``RADIXSERVE_<FLAG>`` (``RADIXSERVE_PAGE_SIZE=16``); see --help.
SIGTERM / Ctrl-C: stop admitting (health NOT_SERVING), let running requests finish for up to
--drain-timeout seconds, abort the rest with a reason the client sees, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
import typing
from collections.abc import Sequence

from radixserve.common.config import add_model_flag, parse_args, resolve_model, served_model_name

_HELP = {
    "chunked_prefill_size": "tokens of one prompt per prefill step; default by device (CUDA 2048,"
    " CPU 256); 0: no chunking",
}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    from radixserve.scheduler.engine import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine (radixserve.Engine arguments)")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = str(hints[f.name])
        if f.name == "disable_overlap":  # None means "by device"; the flag forces it off
            group.add_argument(
                flag, action="store_true", default=None, help="the normal loop (default on CPU)"
            )
            group.add_argument(
                "--enable-overlap",
                dest="disable_overlap",
                action="store_false",
                help="the overlap loop (default on CUDA)",
            )
        elif "bool" in hint:
            group.add_argument(flag, action="store_true", default=f.default)
        else:
            typ = int if "int" in hint else float if "float" in hint else str
            text = _HELP.get(f.name, f"default {f.default}")
            group.add_argument(flag, type=typ, default=f.default, help=text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, typing.Any]:
    from radixserve.scheduler.engine import EngineConfig

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve.scheduler",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flag(p, served_name=True)
    p.add_argument("--host", default="0.0.0.0", help="listen address")
    p.add_argument("--port", type=int, default=50051, help="gRPC port")
    p.add_argument("--advertise-address", help="HOST:PORT others reach this pod at (default localhost:PORT)")
    p.add_argument("--detokenizer", required=True, help="HOST:PORT of the detokenizer")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish requests at SIGTERM")
    p.add_argument(
        "--prefix-index",
        default="",
        help="redis:// or rediss:// URL to publish KV block events "
        "and heartbeats to (default: none; gateways with an in-memory index get them over Watch)",
    )
    p.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0: off)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per hashed block (0: no block events)")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats (Redis)")
    p.add_argument("--heartbeat-ttl", type=float, default=5.0, help="seconds a heartbeat stays valid (Redis)")
    add_engine_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    import torch

    from radixserve.common import telemetry
    from radixserve.scheduler.engine import Engine
    from radixserve.scheduler.server import serve, shutdown

    telemetry.setup_tracing("radixserve-scheduler")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    engine = Engine(resolve_model(args.model), **engine_kwargs(args))
    address = args.advertise_address or f"localhost:{args.port}"
    server, service, health = serve(
        engine,
        f"{args.host}:{args.port}",
        args.detokenizer,
        address,
        model_name=served_model_name(args),
        block_size=args.block_size,
    )
    publisher = None
    if args.prefix_index:
        from radixserve.common.prefix_index import RedisPrefixIndex
        from radixserve.scheduler.kv_events import EventSubscriber, RedisPublisher

        publisher = RedisPublisher(
            RedisPrefixIndex(args.prefix_index),
            address,
            service.events.subscribe(EventSubscriber()),
            service.load_dict,
            args.heartbeat_interval,
            args.heartbeat_ttl,
        )
        publisher.start()
        service.publisher = publisher
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host, registry=service.metrics.registry)
    logging.info("serving on %s:%d (KV %d tokens)", args.host, args.port, engine.scheduler.kv.capacity)
    stop.wait()
    logging.info("shutting down (drain up to %.0f s)", args.drain_timeout)
    if publisher is not None:
        publisher.close()
    shutdown(server, service, health, args.drain_timeout)
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
