"""python -m radixserve.detokenizer: the detokenizer pod.

    python -m radixserve.detokenizer --model PATH|demo --port 50052

Schedulers stream TokenBatches in; text goes to the gateway each request names in reply_to.
Every flag can come from ``RADIXSERVE_<FLAG>`` (see --help). SIGTERM / Ctrl-C: stop, flushing
what is queued for gateways.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from radixserve.common.config import add_model_flag, parse_args, resolve_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve.detokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flag(p)
    p.add_argument("--host", default="0.0.0.0", help="listen address")
    p.add_argument("--port", type=int, default=50052, help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=9401, help="Prometheus /metrics port (0: off)")
    p.add_argument(
        "--workers", type=int, default=64, help="gRPC threads (one per connected scheduler + spare)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s detokenizer %(levelname)s %(message)s")
    from radixserve.common import telemetry
    from radixserve.detokenizer.server import serve

    telemetry.setup_tracing("radixserve-detokenizer")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server, service = serve(str(resolve_model(args.model)), f"{args.host}:{args.port}", args.workers)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host, registry=service.metrics.registry)
    logging.info("serving on %s:%d", args.host, args.port)
    stop.wait()
    server.stop(grace=2).wait()
    service.close()
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
