"""python -m radixserve.tokenizer: the gateway pod (OpenAI HTTP + gRPC Generate, routing, fan-in).

    python -m radixserve.tokenizer --model PATH|demo --schedulers HOST:PORT [HOST:PORT ...] \\
        [--port 8000] [--grpc-port 50050] [--advertise-address HOST:GRPC_PORT]
    python -m radixserve.tokenizer --model PATH|demo --schedulers discover --prefix-index redis://...

--advertise-address is what the detokenizer dials to deliver results (the pod's own address in a
cluster). ``--schedulers discover`` finds the schedulers by their heartbeats in the Redis prefix
index (under --index-key-prefix): schedulers added or removed are picked up within about a second.
Every flag can come from ``RADIXSERVE_<FLAG>`` (lists space-separated); see --help.
SIGTERM / Ctrl-C: stop accepting, give open responses --drain-timeout seconds, exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import Sequence

from radixserve.common.config import (
    ConfigError,
    OneLineParser,
    RaisingParser,
    from_args,
    load_service,
    resolve_model,
    served_model_name,
    service_parser,
)
from radixserve.common.ports import check_listen
from radixserve.common.process_exit import exit_if_still_running_after, exit_now
from radixserve.common.service_config import GatewayConfig

GRPC_GRACE_S = 2.0
STOP_MARGIN_S = 10.0  # beyond the drain and gRPC's grace, before a stop that hangs is cut short


def build_parser(parser_class: type[argparse.ArgumentParser] = OneLineParser) -> argparse.ArgumentParser:
    prog = "python -m radixserve.tokenizer"
    return service_parser(GatewayConfig, prog, __doc__, served_name=True, parser_class=parser_class)


async def run(args: argparse.Namespace) -> None:
    import grpc
    import uvicorn

    from radixserve.common.health import add_health
    from radixserve.common.rpc import SERVER_OPTIONS, listen, pb_grpc
    from radixserve.common.tls import TLSError, load_tls
    from radixserve.tokenizer.gateway import Gateway
    from radixserve.tokenizer.grpc_api import GatewayService
    from radixserve.tokenizer.openai_api.app import build_app

    cfg = from_args(GatewayConfig, args)
    try:
        tls = load_tls(cfg.tls)  # the gRPC port's and the channels to the schedulers'
    except TLSError as e:
        raise SystemExit(f"TLS settings: {e}") from None
    try:
        gw = Gateway(resolve_model(args.model), served_model_name(args), cfg, tls)
    except ValueError as e:  # a setting that cannot work (each message names its flag)
        raise SystemExit(" ".join(f"gateway settings: {e}".split())) from None  # one line
    try:  # after the settings' own errors; a port in use is one line, not uvicorn's or gRPC's bind error
        check_listen(cfg.host, cfg.listens())
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    await gw.start()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_GatewayServicer_to_server(GatewayService(gw), server)
    add_health(server, ["radixserve.v1.Gateway"])
    listen(server, f"{cfg.host}:{cfg.grpc_port}", tls)
    await server.start()
    http = uvicorn.Server(
        uvicorn.Config(
            build_app(gw),
            host=cfg.host,
            port=cfg.port,
            log_level="warning",
            timeout_graceful_shutdown=max(1, int(cfg.drain_timeout)),
        )
    )
    # uvicorn captures SIGTERM/SIGINT while it serves (and stops); ours end the wait if it is not serving.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(http.serve())
    logging.info(
        "HTTP on %s:%d, gRPC on %s:%d, model %s",
        cfg.host,
        cfg.port,
        cfg.host,
        cfg.grpc_port,
        gw.model_name,
    )
    await asyncio.wait({serving, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    # Cancelled once the servers and the gateway are closed: telemetry's flush has its own timeout.
    deadline_timer = exit_if_still_running_after(
        cfg.drain_timeout + GRPC_GRACE_S + STOP_MARGIN_S, "the gateway"
    )
    http.should_exit = True
    await serving
    # gRPC clients' requests still in flight get GRPC_GRACE_S. Not the stop's own grace: the
    # detokenizers' Deliver streams never end by themselves, so it always ran out, delaying each stop.
    deadline = time.monotonic() + GRPC_GRACE_S
    while gw.choices and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=0.2)  # their last responses on the way out
    await gw.close()
    deadline_timer.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    try:  # every setting and the model folder, before the gateway loads anything
        args, _ = load_service(build_parser(RaisingParser), GatewayConfig, argv)
    except ConfigError as e:
        logging.error("%s; exiting with status 1", e)
        return 1
    from radixserve.common import telemetry

    telemetry.setup_tracing("radixserve-gateway")
    try:
        asyncio.run(run(args))
    finally:
        telemetry.shutdown()
    return 0


if __name__ == "__main__":
    exit_now(main())
