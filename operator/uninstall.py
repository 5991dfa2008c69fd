"""``python -m radixserve.operator.uninstall``: the chart's pre-delete hook.

The operator holds a finalizer on every InferenceService and GPUNodePool it serves (kopf makes one
mandatory while a resource has timers, and ours resync every few seconds). ``helm uninstall``
deletes the operator's Deployment in the same breath as everything else, so whatever outlives it
keeps a finalizer nobody will remove: a later delete hangs. This hook runs first, while the
operator still serves: it deletes every InferenceService in the operator's namespaces and the
GPUNodePools (every one for a cluster-wide operator; for one limited to namespaces, only the
chart's own: the others may serve other releases), their workloads going with them through owner
references and each service's Redis user with the operator's help, and waits until the operator
has released them all.

Exit status 0 when everything is gone; 1, naming what is left, when the wait times out (Helm then
stops the uninstall, leaving the operator running, so it can be retried).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from radixserve.operator.kube import Kube, KubeError, load_config

log = logging.getLogger(__name__)

# Namespaced kinds first: a service's scheduler pods count against its pool's GPUs.
NAMESPACED = {"InferenceService": True, "GPUNodePool": False}  # kind -> namespaced, in this order
USER_AGENT = "radixserve-uninstall"  # its own ServiceAccount and ClusterRole (the chart's hook)


def _present(
    kube: Kube, namespaces: Sequence[str], pools: Sequence[str] | None
) -> list[tuple[str, str | None, str]]:
    """(kind, namespace, name) of every object of ours still there (none of a kind not served)."""
    found = []
    for kind, namespaced in NAMESPACED.items():
        scopes: Sequence[str | None] = namespaces if namespaced and namespaces else [None]
        for ns in scopes:
            try:
                objs = kube.list(kind, ns)
            except KubeError as e:
                if e.status != 404:  # the CRD is gone already: nothing of that kind is left
                    raise
                objs = []
            for obj in objs:
                meta = obj.get("metadata", {})
                if kind == "GPUNodePool" and pools is not None and meta["name"] not in pools:
                    continue
                found.append((kind, meta.get("namespace"), meta["name"]))
    return found


def delete_all(
    kube: Kube,
    namespaces: Sequence[str] = (),
    timeout_s: float = 300.0,
    poll_s: float = 1.0,
    pools: Sequence[str] | None = None,
) -> list[str]:
    """Delete every InferenceService (in ``namespaces``, or all) and the GPUNodePools (``pools``, or
    all), then wait for them to go; returns ``kind ns/name`` of those still present at the deadline
    (empty: all gone). An operator of some namespaces shares the cluster-scoped pools with others:
    the chart passes only its own pool then."""
    for kind, ns, name in _present(kube, namespaces, pools):
        log.info("deleting %s %s/%s", kind, ns or "-", name)
        kube.delete(kind, ns, name)
    deadline = time.monotonic() + timeout_s
    while True:
        left = _present(kube, namespaces, pools)
        if not left or time.monotonic() >= deadline:
            return [f"{kind} {ns + '/' if ns else ''}{name}" for kind, ns, name in left]
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixserve.operator.uninstall", description=__doc__)
    p.add_argument("--namespace", action="append", default=[], help="the operator's (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the finalizers")
    p.add_argument(
        "--pool",
        action="append",
        default=None,
        help="delete only these GPUNodePools (repeatable; with --namespace the chart passes its own, or"
        " --pool= for none); default: every pool",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_config()
    pools = None if args.pool is None else [p for p in args.pool if p]
    left = delete_all(Kube(user_agent=USER_AGENT), args.namespace, args.timeout, pools=pools)
    if left:
        print(
            f"still present after {args.timeout:.0f} s (is the operator running?): {', '.join(left)}",
            file=sys.stderr,
        )
        return 1
    print("every InferenceService and GPUNodePool is gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
