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

from radixserve.common.config import add_flags, add_model_flag, from_args, parse_args, resolve_model
from radixserve.common.service_config import DetokenizerConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve.detokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flag(p)
    add_flags(p, DetokenizerConfig)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    cfg = from_args(DetokenizerConfig, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s detokenizer %(levelname)s %(message)s")
    from radixserve.common import telemetry
    from radixserve.common.rpc import TLSError, load_tls
    from radixserve.detokenizer.server import serve

    try:
        tls = load_tls(cfg.tls)
    except TLSError as e:
        logging.error("TLS settings: %s", e)
        return 1
    telemetry.setup_tracing("radixserve-detokenizer")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server, service = serve(str(resolve_model(args.model)), f"{cfg.host}:{cfg.port}", cfg.workers, tls)
    if cfg.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port, addr=cfg.host, registry=service.metrics.registry)
    logging.info("serving on %s:%d", cfg.host, cfg.port)
    stop.wait()
    server.stop(grace=2).wait()
    service.close()
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
