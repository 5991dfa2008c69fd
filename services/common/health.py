"""grpc.health.v1 in every service (``add_health``, what Kubernetes' probes call), the check
(``is_serving``), and the probe command ``python -m radixserve.common.health HOST:PORT [--timeout S]
[--service NAME]``: one health check of service NAME (default "": the server's), exit 0 when it
reports SERVING, 1 otherwise (unreachable, NOT_SERVING, a TLS handshake refused), 2 on bad arguments
or TLS settings that cannot work.

Kubernetes' built-in gRPC probes speak plaintext only; with TLS between the pods (the
RADIXSERVE_TLS_* variables, read as the services read them) the operator makes this an exec probe,
which dials with the pod's own certificate, CA and server name (so mutual TLS works too).
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixserve.common.rpc import channel
from radixserve.common.tls import TLS, TLSError, tls_from_env


def add_health(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    """Serve grpc.health.v1 (what Kubernetes gRPC probes call) for "" and each service name."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def set_not_serving(servicer: health.HealthServicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def is_serving(address: str, timeout: float = 1.0, tls: TLS | None = None, service: str = "") -> bool:
    """Whether the gRPC health service ``service`` at ``address`` reports SERVING ("": the server's)."""
    try:
        with channel(address, tls, options=()) as ch:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = health_pb2_grpc.HealthStub(ch).Check(request, timeout=timeout)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radixserve.common.health",
        description="Exit 0 when the gRPC health service at HOST:PORT reports SERVING, else 1. "
        "TLS: the RADIXSERVE_TLS_* variables, as the services read them.",
    )
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--timeout", type=float, default=1.0, help="seconds to wait (default 1)")
    parser.add_argument(
        "--service",
        default="",
        help='health service to ask (default "": the server; a scheduler\'s liveness probe asks "liveness")',
    )
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout}: expected a positive number of seconds")
    try:
        tls = tls_from_env(os.environ)
    except TLSError as e:
        print(f"health: {e}", file=sys.stderr)
        return 2
    if is_serving(args.address, args.timeout, tls, args.service):
        return 0
    what = f"{args.address} ({args.service})" if args.service else args.address
    print(f"health: {what} is not serving", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
