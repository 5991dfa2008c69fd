"""python -m radixserve.operator: run the operator (what the chart's Deployment runs).

    python -m radixserve.operator [--namespace NS ...] [--liveness http://0.0.0.0:8080/healthz]

Without --namespace it watches the whole cluster (GPUNodePools and Nodes are cluster-scoped
anyway). Credentials: the pod's service account, else $KUBECONFIG.
"""

from __future__ import annotations

import argparse
import logging
import sys

import kopf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixserve.operator", description=__doc__.split("\n")[0])
    p.add_argument("--namespace", action="append", default=[], help="watch only these (repeatable)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf's liveness endpoint")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)

    import radixserve.operator.handlers  # noqa: F401  (registers the handlers with kopf)

    # One replica (the chart's Deployment uses Recreate), so no peering objects are needed.
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
