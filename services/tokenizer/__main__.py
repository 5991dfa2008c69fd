"""python -m radixserve.tokenizer: the gateway pod (OpenAI HTTP + gRPC Generate, routing, fan-in).

    python -m radixserve.tokenizer --model PATH|demo --schedulers HOST:PORT [HOST:PORT ...] \\
        [--port 8000] [--grpc-port 50050] [--advertise-address HOST:GRPC_PORT]

--advertise-address is what the detokenizer dials to deliver results (the pod's own address in a
cluster). Every flag can come from ``RADIXSERVE_<FLAG>`` (lists space-separated); see --help.
SIGTERM / Ctrl-C: stop accepting, give open responses --drain-timeout seconds, exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from radixserve.common.config import add_model_flag, parse_args, resolve_model, served_model_name
from radixserve.tokenizer.router import ROUTERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve.tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flag(p, served_name=True)
    p.add_argument("--host", default="0.0.0.0", help="listen address (HTTP and gRPC)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (OpenAI API)")
    p.add_argument(
        "--grpc-port", type=int, default=50050, help="gRPC port (Generate; the detokenizer's Deliver)"
    )
    p.add_argument(
        "--advertise-address",
        help="HOST:PORT the detokenizer reaches the gRPC port at (default localhost:GRPC_PORT)",
    )
    p.add_argument("--schedulers", nargs="+", required=True, help="scheduler pods, HOST:PORT each")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="at SIGTERM, seconds open responses get to finish (match the schedulers')",
    )
    p.add_argument("--router", choices=ROUTERS, default="cache-aware", help="routing policy")
    p.add_argument(
        "--prefix-index",
        default="memory",
        help='"memory" (fed by the schedulers\' Watch '
        "streams; one gateway) or a redis:// / rediss:// URL (password in the URL)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per hashed block (as the schedulers)")
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=16,
        help="cache-aware: route to the least loaded pod when loads differ by more than this ...",
    )
    p.add_argument(
        "--balance-rel-threshold", type=float, default=1.5, help="... and by more than this factor"
    )
    p.add_argument(
        "--recent-ttl",
        type=float,
        default=10.0,
        help="seconds a prefix counts as held by the pod it was just routed to",
    )
    p.add_argument(
        "--lost-response-check",
        type=float,
        default=10.0,
        help="seconds without news of a request before asking its scheduler whether it still holds it"
        " (one it ended whose response never came is failed with 503, not left hanging); 0: off",
    )
    p.add_argument(
        "--scheduler-stale-after",
        type=float,
        default=5.0,
        help="seconds without a load report after which a scheduler counts as down: its requests move"
        " to another scheduler (no text yet) or fail with 503, not left hanging (at least 5 reports)",
    )
    p.add_argument(
        "--working-set-window",
        type=float,
        default=60.0,
        help="cache-aware: a new prefix goes to the pod sent the fewest prefix blocks in this many seconds",
    )
    p.add_argument(
        "--kv-fill",
        type=float,
        default=0.9,
        help="cache-aware: a new prefix goes first to pods where those blocks + the prompt stay within"
        " this share of the pod's KV capacity",
    )
    return p


async def run(args: argparse.Namespace) -> None:
    import grpc
    import uvicorn

    from radixserve.common.rpc import SERVER_OPTIONS, add_health, pb_grpc
    from radixserve.tokenizer.gateway import Gateway, RoutingConfig
    from radixserve.tokenizer.grpc_api import GatewayService
    from radixserve.tokenizer.http_app import build_app

    routing = RoutingConfig(
        policy=args.router,
        prefix_index=args.prefix_index,
        block_size=args.block_size,
        balance_abs=args.balance_abs_threshold,
        balance_rel=args.balance_rel_threshold,
        recent_ttl_s=args.recent_ttl,
        working_set_s=args.working_set_window,
        kv_fill=args.kv_fill,
    )
    gw = Gateway(
        resolve_model(args.model),
        served_model_name(args),
        args.schedulers,
        args.advertise_address or f"localhost:{args.grpc_port}",
        routing,
        lost_check_s=args.lost_response_check,
        stale_s=args.scheduler_stale_after,
    )
    await gw.start()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_GatewayServicer_to_server(GatewayService(gw), server)
    add_health(server, ["radixserve.v1.Gateway"])
    if server.add_insecure_port(f"{args.host}:{args.grpc_port}") == 0:
        raise OSError(f"cannot listen on {args.host}:{args.grpc_port}")
    await server.start()
    http = uvicorn.Server(
        uvicorn.Config(
            build_app(gw),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=max(1, int(args.drain_timeout)),
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
        args.host,
        args.port,
        args.host,
        args.grpc_port,
        gw.model_name,
    )
    await asyncio.wait({serving, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    http.should_exit = True
    await serving
    await server.stop(grace=2)
    await gw.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    from radixserve.common import telemetry

    telemetry.setup_tracing("radixserve-gateway")
    try:
        asyncio.run(run(args))
    finally:
        telemetry.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
