"""kopf handlers for GPUNodePools (and the Nodes they claim): label and taint the matching nodes,
give them back, count GPUs. The ``pools`` index feeds the InferenceService handlers too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict, cast

import kopf

from radixserve.operator import manifests, nodepool, status
from radixserve.operator.config import OperatorConfig
from radixserve.operator.crds import GPU_NODE_POOL_SPEC, GROUP, VERSION
from radixserve.operator.kube import Kube
from radixserve.operator.objects import Obj
from radixserve.operator.schema import apply_defaults

POOL = (GROUP, VERSION, "gpunodepools")
POOL_INTERVAL_S = OperatorConfig.from_env().pool_interval_s  # fixed when the timer registers
SCHEDULER_PODS = f"app.kubernetes.io/component=scheduler,app.kubernetes.io/managed-by={manifests.MANAGED_BY}"


def _pool_spec(spec: Mapping[str, object]) -> Obj:
    return apply_defaults(GPU_NODE_POOL_SPEC, dict(spec))


class PoolEntry(TypedDict):
    """The ``pools`` index's value for a GPUNodePool (keyed by its name)."""

    spec: Obj  # defaulted
    status: Obj


PoolIndex = kopf.Index[str, PoolEntry]


@kopf.index(*POOL)
def pools(
    name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, **_: object
) -> dict[str, PoolEntry] | None:
    if meta.get("deletionTimestamp"):
        return None  # a pool on its way out claims no more nodes
    return {name: {"spec": _pool_spec(spec), "status": dict(status)}}


def pool_entry(pools: PoolIndex, pool_name: str | None) -> PoolEntry | None:
    return next(iter(pools.get(pool_name, [])), None) if pool_name else None


def sync_pool(name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch) -> None:
    """Label and taint the matching nodes, release the ones that stopped matching, count GPUs."""
    kube: Kube = memo.kube
    s = _pool_spec(spec)
    generation = int(body.get("metadata", {}).get("generation") or 1)
    previous = body.get("status", {}).get("conditions")
    refused = nodepool.pool_problems(s)
    if refused:  # the CRD refuses these; a server without CEL (or an emulator) leaves it to us
        ready = status.condition(
            "Ready", False, "InvalidSpec", "; ".join(refused), generation, previous, status.now_iso()
        )
        refusal: Obj = {"conditions": [ready], "observedGeneration": generation}
        status.write_status(patch, dict(body.get("status") or {}), refusal)
        return
    selector = s["nodeSelector"]
    taint = s.get("taint")
    members = []
    # Candidates: the nodes the selector matches and the nodes we labelled before (they may have
    # stopped matching). Selectors go to the server and are checked here too (an emulator or a
    # proxy may ignore them); an empty selector matches nothing rather than every node.
    candidates = {n["metadata"]["name"]: n for n in kube.list("Node", None, f"{manifests.POOL_LABEL}={name}")}
    if selector:
        match = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        candidates.update({n["metadata"]["name"]: n for n in kube.list("Node", None, match)})
    for node_name, node in sorted(candidates.items()):
        if nodepool.node_matches(node, selector):
            members.append(node)
            change = nodepool.join_patch(node, name, taint)
        else:
            change = nodepool.leave_patch(node, name, taint)
        if change:
            kube.merge_patch("Node", None, node_name, change)
    requested = 0
    for pod in kube.list("Pod", None, SCHEDULER_PODS):
        if nodepool.pod_pool(pod) == name:
            requested += nodepool.pod_gpus(pod, s["gpuResourceName"])
    st = nodepool.pool_status(members, s["gpuResourceName"], requested)
    has_nodes = st["nodes"] > 0
    message = (
        f"{st['nodes']} nodes, {st['gpus']['allocatable']} GPUs allocatable"
        if has_nodes
        else f"no node matches {selector}"
    )
    st["conditions"] = [
        status.condition(
            "Ready",
            has_nodes,
            "NodesFound" if has_nodes else "NoMatchingNodes",
            message,
            generation,
            previous,
            status.now_iso(),
        )
    ]
    st["observedGeneration"] = generation
    status.write_status(patch, dict(body.get("status") or {}), st)


@kopf.on.create(*POOL)
def pool_created(
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: object
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.on.update(*POOL)
def pool_updated(
    name: str,
    spec: kopf.Spec,
    old: kopf.BodyEssence | None,
    body: kopf.Body,
    memo: kopf.Memo,
    patch: kopf.Patch,
    **_: object,
) -> None:
    # A changed taint: take the old one off our nodes first (sync_pool only knows the new one).
    old_taint = _pool_spec((old or {}).get("spec") or {}).get("taint")
    if old_taint and old_taint != _pool_spec(spec).get("taint"):
        _release_nodes(memo.kube, name, old_taint, keep_label=True)
    sync_pool(name, spec, body, memo, patch)


@kopf.on.resume(*POOL)
def pool_resumed(
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: object
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.timer(*POOL, interval=POOL_INTERVAL_S, initial_delay=POOL_INTERVAL_S)
def pool_resync(
    name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: object
) -> None:
    sync_pool(name, spec, body, memo, patch)


@kopf.on.delete(*POOL)
def pool_deleted(name: str, spec: kopf.Spec, memo: kopf.Memo, **_: object) -> None:
    """Give the nodes back: drop our label and taint."""
    _release_nodes(memo.kube, name, _pool_spec(spec).get("taint"))


def _release_nodes(kube: Kube, pool: str, taint: Obj | None, keep_label: bool = False) -> None:
    for node in kube.list("Node", None, f"{manifests.POOL_LABEL}={pool}"):
        change = nodepool.leave_patch(node, pool, taint)
        if change and keep_label:
            change.pop("metadata", None)
        if change:
            kube.merge_patch("Node", None, node["metadata"]["name"], change)


@kopf.on.event("v1", "nodes")
def node_changed(type: str, body: kopf.Body, memo: kopf.Memo, **kw: object) -> None:
    """A node joined or changed labels: label and taint it now rather than at the next resync."""
    if type == "DELETED" or getattr(memo, "kube", None) is None:
        return
    pools = cast(PoolIndex, kw["pools"])
    node = dict(body)
    for pool_name, store in pools.items():
        for pool in store:
            if not nodepool.node_matches(node, pool["spec"].get("nodeSelector") or {}):
                continue
            change = nodepool.join_patch(node, pool_name, pool["spec"].get("taint"))
            # The index can lag a pool's deletion by an event: ask the API before claiming.
            live = memo.kube.get("GPUNodePool", None, pool_name) if change else None
            if live and not live["metadata"].get("deletionTimestamp"):
                memo.kube.merge_patch("Node", None, node["metadata"]["name"], change)
                return
