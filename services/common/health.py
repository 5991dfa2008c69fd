"""``python -m radixserve.common.health HOST:PORT [--timeout S] [--service NAME]``: one gRPC health
check (grpc.health.v1, service NAME, default "": the server's), exit 0 when it reports SERVING, 1
otherwise (unreachable, NOT_SERVING, a TLS handshake refused), 2 on bad arguments or TLS settings
that cannot work.

Kubernetes' built-in gRPC probes speak plaintext only; with TLS between the pods (the
RADIXSERVE_TLS_* variables, read as the services read them) the operator makes this an exec probe,
which dials with the pod's own certificate, CA and server name (so mutual TLS works too).
"""

from __future__ import annotations

import argparse
import os
import sys

from radixserve.common.rpc import TLSError, is_serving, tls_from_env


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
