"""The operator brings its own CRDs up to date at start-up (``python -m radixserve.operator
--apply-crds``; the chart passes it by default).

Helm installs ``crds/`` on ``helm install`` and never touches it again: ``helm upgrade`` would leave
the old schemas in place, so a new field the new operator understands would be pruned by the API
server before the operator sees it. Templating the CRDs instead does not work on a first install
(Helm checks the chart's own InferenceService / GPUNodePool / peering objects against kinds that
do not exist yet). So ``crds/`` creates them and each operator, once started, server-side applies
the schemas it was built with (``crds.CRDS``, the same single source ``crds/`` is rendered from).
The chart's ClusterRole lets it patch those two CRDs by name and nothing else: it cannot create,
delete or alter any other CRD.
"""

from __future__ import annotations

import copy
import logging

from radixserve.operator.crds import CRD_REVISION, CRDS, REVISION_ANNOTATION
from radixserve.operator.kube import Kube, KubeError
from radixserve.operator.objects import Obj

log = logging.getLogger(__name__)


def cluster_revision(crd: Obj | None) -> int:
    """The ``crds.REVISION_ANNOTATION`` of a CRD as the cluster has it (0: none, or an older chart's)."""
    raw = ((crd or {}).get("metadata", {}).get("annotations") or {}).get(REVISION_ANNOTATION, "0")
    return int(raw) if str(raw).isdigit() else 0


def apply_crds(kube: Kube) -> list[str]:
    """Server-side apply every CRD of ours over an older or equal revision; returns the names applied.
    A newer one is left alone (this replica is the older: a rollback, a pod restarting mid-rollout),
    and so is a CRD that may not be read or patched (RBAC: the chart's crds.upgrade off) or is
    missing: an operator with a stale schema still runs, it only cannot use the newest fields."""
    done = []
    for crd in CRDS.values():
        name = crd["metadata"]["name"]
        try:
            theirs = cluster_revision(kube.get("CustomResourceDefinition", None, name))
            if theirs > CRD_REVISION:
                log.warning(
                    "CRD %s is at revision %d, newer than this operator's %d: left as it is",
                    name,
                    theirs,
                    CRD_REVISION,
                )
                continue
            kube.apply(copy.deepcopy(crd))
        except KubeError as e:
            log.warning(
                "cannot update CRD %s (HTTP %s): the cluster keeps its current schema", name, e.status
            )
            continue
        done.append(name)
    return done
