"""PodDisruptionBudgets for one InferenceService: voluntary disruptions (node drains, cluster
autoscaler scale-downs, upgrades) take its gateways and its schedulers one pod at a time.

    NAME-gateway    maxUnavailable 1   the other gateways keep serving while one moves
    NAME-scheduler  maxUnavailable 1   each scheduler holds GPUs and a warm prefix cache: losing
                                       several at once would cut capacity and every cached prefix

maxUnavailable rather than minAvailable: a single-replica component can still be drained (its
pod moves, with a short gap), where minAvailable 1 would block every drain of that node for good.
The detokenizer is left without one: it is stateless and quick to start again.
"""

from __future__ import annotations

from radixserve.operator.manifests import BuildContext, _meta, selector
from radixserve.operator.objects import Obj

COMPONENTS = ("gateway", "scheduler")


def budget(ctx: BuildContext, component: str) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(ctx, component, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(ctx, component)}},
    }


def build(ctx: BuildContext) -> list[Obj]:
    return [budget(ctx, c) for c in COMPONENTS]
