"""python -m radixserve.detokenizer: the detokenizer pod.

    python -m radixserve.detokenizer --model PATH|demo --port 50052

Schedulers stream TokenBatches in; text goes to the gateway each request names in reply_to.
Every flag can come from ``RADIXSERVE_<FLAG>`` (see --help). SIGTERM / Ctrl-C: stop, flushing
what is queued for gateways.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from radixserve.common.config import (
    ConfigError,
    OneLineParser,
    RaisingParser,
    load_service,
    resolve_model,
    service_parser,
)
from radixserve.common.ports import check_listen
from radixserve.common.process_exit import exit_now
from radixserve.common.service_config import DetokenizerConfig
from radixserve.common.stop_signal import StopSignal


def build_parser(parser_class: type[argparse.ArgumentParser] = OneLineParser) -> argparse.ArgumentParser:
    prog = "python -m radixserve.detokenizer"
    return service_parser(DetokenizerConfig, prog, __doc__, parser_class=parser_class)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s detokenizer %(levelname)s %(message)s")
    stop = StopSignal(exit_until_ready=True).install()  # until it serves, a signal ends it
    try:  # every setting, the model folder and the ports, before the tokenizer loads
        args, cfg = load_service(build_parser(RaisingParser), DetokenizerConfig, argv)
        check_listen(cfg.host, cfg.listens())  # a port in use: one line, not gRPC's bind error
    except ConfigError as e:
        return _failed(str(e))
    from radixserve.common import telemetry
    from radixserve.common.tls import TLSError, load_tls
    from radixserve.detokenizer.server import serve

    try:
        tls = load_tls(cfg.tls)
    except TLSError as e:
        return _failed(f"TLS settings: {e}")
    telemetry.setup_tracing("radixserve-detokenizer")

    try:
        server, service = serve(str(resolve_model(args.model)), f"{cfg.host}:{cfg.port}", cfg.workers, tls)
    except (OSError, ValueError) as e:  # a tokenizer transformers cannot load from the model's folder
        return _failed(f"cannot load the tokenizer of --model {args.model}: {e}")
    if cfg.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port, addr=cfg.host, registry=service.metrics.registry)
    logging.info("serving on %s:%d", cfg.host, cfg.port)
    stop.ready()
    while not stop.wait(1.0):
        pass
    server.stop(grace=2).wait()
    service.close()
    telemetry.shutdown()
    return 0


def _failed(reason: str) -> int:
    """Say why the detokenizer stops, in one line (a library's message may span several)."""
    logging.error("%s; exiting with status 1", " ".join(reason.split()))
    return 1


if __name__ == "__main__":
    exit_now(main())
