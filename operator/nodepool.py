"""GPUNodePool logic (pure): which nodes belong, what to patch on them, what the pool holds.

Scheduler pods select the pool's own ``nodeSelector`` (manifests._place_on_pool): labels the provider
puts on every node of the group (cloud.google.com/gke-accelerator, karpenter.sh/nodepool,
node.kubernetes.io/instance-type, ...), so a pending scheduler pod matches the node template of a
cluster autoscaler or Karpenter and makes it add a node. Nothing the operator writes on a node is
needed to schedule there. The operator still, on the nodes that exist and match:

- labels them ``radixserve.io/gpu-node-pool: NAME``: bookkeeping only (``kubectl get nodes -l``, and
  the pool given back cleanly at deletion); and
- taints them with the pool's ``taint`` (the scheduler pods tolerate it): this reserves a static pool
  for schedulers. A node the autoscaler adds is tainted only once the operator sees it, and pods
  placed in between stay, so for autoscaled pools put the same taint in the provider's node template
  (Karpenter NodePool ``spec.template.spec.taints``, the node group's taints) as well.

Node counts (minNodes, maxNodes) are the provider's: its object says how far a group may grow
(Karpenter NodePool ``spec.limits``, the node group's min and max size), so the pool refuses them.
"""

from __future__ import annotations

from radixserve.operator.manifests import POOL_LABEL
from radixserve.operator.objects import Obj

NODE_LIMITS_MESSAGE = (
    "minNodes and maxNodes are not supported: set node limits on the provider's object (Karpenter "
    "NodePool spec.limits, the cluster autoscaler node group's min/max size)"
)


def pool_problems(spec: Obj) -> list[str]:
    """What the operator refuses in a GPUNodePool's defaulted ``spec`` (the CRD refuses it too)."""
    problems = []
    if not spec.get("nodeSelector"):
        problems.append("spec.nodeSelector is empty: it would match every node")
    if spec.get("minNodes") or spec.get("maxNodes"):
        problems.append(NODE_LIMITS_MESSAGE)
    return problems


def node_matches(node: Obj, node_selector: dict[str, str]) -> bool:
    node_labels = _labels(node)
    return bool(node_selector) and all(node_labels.get(k) == v for k, v in node_selector.items())


def _labels(node: Obj) -> dict[str, str]:
    return node.get("metadata", {}).get("labels") or {}


def _taints(node: Obj) -> list[Obj]:
    return node.get("spec", {}).get("taints") or []


def _taint_of(taint: Obj) -> Obj:
    return {"key": taint["key"], "value": taint["value"], "effect": taint["effect"]}


def _is_taint(node_taint: Obj, taint: Obj) -> bool:
    """Whether a node's taint (its value may be left out) is ``taint``."""
    return _taint_of({"value": "", **node_taint}) == _taint_of(taint)


def join_patch(node: Obj, pool: str, taint: Obj | None) -> Obj | None:
    """A merge patch that labels (and taints) the node for ``pool``; None when it already is."""
    patch: Obj = {}
    if _labels(node).get(POOL_LABEL) != pool:
        patch["metadata"] = {"labels": {POOL_LABEL: pool}}
    if taint and not any(_is_taint(t, taint) for t in _taints(node)):
        # Merge patches replace lists whole: send the node's other taints along.
        patch["spec"] = {"taints": [*_taints(node), _taint_of(taint)]}
    return patch or None


def leave_patch(node: Obj, pool: str, taint: Obj | None) -> Obj | None:
    """The merge patch that undoes :func:`join_patch` (on pool deletion or a selector change)."""
    if _labels(node).get(POOL_LABEL) != pool:
        return None  # not ours: another pool's node may carry the same taint
    patch: Obj = {"metadata": {"labels": {POOL_LABEL: None}}}
    if taint and any(_is_taint(t, taint) for t in _taints(node)):
        patch["spec"] = {"taints": [t for t in _taints(node) if not _is_taint(t, taint)]}
    return patch


def _quantity(value: object) -> int:
    """GPU counts are whole numbers ("8", 8); anything odd counts as none."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def _ready(node: Obj) -> bool:
    conds = node.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def pod_pool(pod: Obj) -> str | None:
    """The GPUNodePool a scheduler pod was placed on: its pool label (manifests._place_on_pool), or,
    for pods made before that label, the pool label its node selector named."""
    meta_labels = pod.get("metadata", {}).get("labels") or {}
    if POOL_LABEL in meta_labels:
        return str(meta_labels[POOL_LABEL])
    selected = (pod.get("spec", {}).get("nodeSelector") or {}).get(POOL_LABEL)
    return str(selected) if selected else None


def pod_gpus(pod: Obj, resource: str) -> int:
    if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
        return 0
    containers = pod.get("spec", {}).get("containers") or []
    return sum(_quantity((c.get("resources", {}).get("limits") or {}).get(resource, 0)) for c in containers)


def pool_status(nodes: list[Obj], resource: str, requested: int) -> Obj:
    """Counts for ``status``: every node, its GPUs, and what our scheduler pods ask of them."""
    total = sum(_quantity((n.get("status", {}).get("capacity") or {}).get(resource, 0)) for n in nodes)
    usable = [n for n in nodes if _ready(n) and not n.get("spec", {}).get("unschedulable")]
    allocatable = sum(
        _quantity((n.get("status", {}).get("allocatable") or {}).get(resource, 0)) for n in usable
    )
    return {
        "nodes": len(nodes),
        "readyNodes": len(usable),
        "nodeNames": sorted(n["metadata"]["name"] for n in nodes),
        "gpus": {"total": total, "allocatable": allocatable, "requested": requested},
    }
