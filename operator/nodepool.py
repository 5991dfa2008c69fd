"""GPUNodePool logic (pure): which nodes belong, what to patch on them, what the pool holds."""

from __future__ import annotations

from radixserve.operator.manifests import POOL_LABEL, Obj


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
