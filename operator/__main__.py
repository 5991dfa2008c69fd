"""python -m radixserve.operator: run the operator (what the chart's Deployment runs).

    python -m radixserve.operator [--namespace NS ...] [--peering NAME] [--liveness URL]

Without --namespace it watches the whole cluster (GPUNodePools and Nodes are cluster-scoped
anyway). Credentials: the pod's service account, else $KUBECONFIG.

With --peering, several replicas run and one serves: kopf's peering objects (ClusterKopfPeering
NAME, or KopfPeering NAME in each watched namespace; the chart makes them) carry each replica's
priority, and every replica pauses while one with a higher priority is alive (its last heartbeat
younger than --peering-lifetime). Equal priorities freeze them all, so each replica takes the time
it started, in milliseconds: the newest replica serves (a rollout hands over to the new pod) and
the others stand by, taking over within one lifetime of its end. Without --peering: standalone.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time

import kopf


def start_priority(now_s: float | None = None) -> int:
    """This replica's peering priority: the start time in ms (the newest wins) and three random digits
    to break a tie; below 2**53 (exact in JSON's doubles) until the year 2255."""
    now_ms = int((time.time() if now_s is None else now_s) * 1000)
    return now_ms * 1000 + random.randrange(1000)


def _register_crd_upgrade() -> None:
    from radixserve.operator.crd_sync import apply_crds
    from radixserve.operator.kube import Kube

    @kopf.on.startup()
    def upgrade_crds(logger: kopf.Logger, **_: object) -> None:
        logger.info(f"CRDs up to date: {', '.join(apply_crds(Kube())) or 'none (see the warnings)'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixserve.operator", description=__doc__.split("\n")[0])
    p.add_argument("--namespace", action="append", default=[], help="watch only these (repeatable)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf's liveness endpoint")
    p.add_argument("--peering", default="", help="kopf peering object's name (several replicas, one active)")
    p.add_argument("--peering-lifetime", type=int, default=30, help="seconds a silent peer counts as alive")
    p.add_argument(
        "--apply-crds", action="store_true", help="server-side apply our CRDs at start (helm upgrade)"
    )
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)

    import radixserve.operator.handlers  # noqa: F401  (registers the handlers with kopf)

    if args.apply_crds:
        _register_crd_upgrade()

    settings = kopf.OperatorSettings()
    settings.peering.lifetime = args.peering_lifetime
    settings.peering.mandatory = bool(args.peering)  # a missing peering object is an error, not solo
    kopf.run(
        standalone=not args.peering,
        peering_name=args.peering or None,
        priority=start_priority() if args.peering else None,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        settings=settings,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
