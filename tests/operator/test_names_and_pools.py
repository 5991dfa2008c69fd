"""InferenceService names the children can carry, and scheduler placement on GPUNodePools that a
cluster autoscaler grows (pure)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from radixserve.operator import crds, nodepool
from radixserve.operator.manifests import MAX_NAME_LENGTH, scheduler_statefulset
from radixserve.operator.validation import NAME_FORMAT, name_problems, validate
from tests.operator.specs import ctx, spec


def test_the_name_limit_is_what_the_scheduler_pods_revision_label_leaves() -> None:
    # controller-revision-hash: NAME-scheduler-HASH, HASH up to 10 characters, a label value <= 63
    assert MAX_NAME_LENGTH == 42
    longest = "n" * MAX_NAME_LENGTH
    assert len(f"{longest}-scheduler-{'h' * 10}") == 63
    assert name_problems(longest) == []
    (problem,) = name_problems(longest + "n")
    assert problem.reason == "InvalidName"
    assert "at most 42 characters" in problem.message and "controller-revision-hash" in problem.message


@pytest.mark.parametrize("name", ["Llama", "1llama", "llama.v2", "llama-", "lla_ma"])
def test_names_that_are_not_dns_labels_starting_with_a_letter_are_refused(name: str) -> None:
    (problem,) = name_problems(name)
    assert problem.reason == "InvalidName" and "NAME-gateway" in problem.message


def test_the_crd_refuses_the_same_names_with_cel_rules_the_api_server_reads() -> None:
    root = crds.INFERENCE_SERVICE_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = root["x-kubernetes-validations"]
    assert all(set(r) == {"rule", "message"} and r["message"] for r in rules)  # the fields CEL takes
    by_rule = {r["rule"]: r["message"] for r in rules}
    assert by_rule[f"self.metadata.name.size() <= {MAX_NAME_LENGTH}"] == name_problems("n" * 43)[0].message
    assert by_rule[f"self.metadata.name.matches('{NAME_FORMAT}')"] == name_problems("A")[0].message
    # The pattern both use (CEL's matches() and the operator's re.fullmatch) takes DNS-1035 labels.
    names = [("llama-3", True), ("a", True), ("3b", False), ("a.b", False), ("a-", False), ("a\n", False)]
    for name, ok in names:
        assert bool(re.fullmatch(NAME_FORMAT, name)) == ok
        assert (name_problems(name) == []) == ok


def test_any_gpu_count_is_tensor_parallelism_not_a_problem() -> None:
    for gpus in (1, 2, 4, 8):
        assert validate(spec(scheduler={"gpusPerReplica": gpus}), None, "redis://r") == []
    described = crds.INFERENCE_SERVICE_SPEC["properties"]["scheduler"]["properties"]["gpusPerReplica"]
    assert "tensor parallelism" in described["description"]


KARPENTER = {
    "nodeSelector": {"karpenter.sh/nodepool": "gpu", "node.kubernetes.io/instance-type": "p5.48xlarge"},
    "taint": {},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}


def test_schedulers_select_the_pools_own_labels_and_tolerate_its_taints() -> None:
    template = scheduler_statefulset(ctx(pool=KARPENTER))["spec"]["template"]
    pod = template["spec"]
    # Labels Karpenter (or the cloud) puts on every node it adds: a pending pod matches its template.
    assert pod["nodeSelector"] == KARPENTER["nodeSelector"]
    assert pod["tolerations"] == [
        {"key": "radixserve.io/inference", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert template["metadata"]["labels"]["radixserve.io/gpu-node-pool"] == "h100"
    untainted = scheduler_statefulset(ctx(pool={"nodeSelector": {"gpu": "a"}}))["spec"]["template"]["spec"]
    assert "tolerations" not in untainted


def test_the_pool_counts_pods_by_their_label_and_older_pods_by_their_selector() -> None:
    assert nodepool.pod_pool({"metadata": {"labels": {"radixserve.io/gpu-node-pool": "a"}}}) == "a"
    old = {"metadata": {}, "spec": {"nodeSelector": {"radixserve.io/gpu-node-pool": "b"}}}
    assert nodepool.pod_pool(old) == "b"
    assert nodepool.pod_pool({"metadata": {}, "spec": {}}) is None


@pytest.mark.parametrize(
    ("pool", "words"),
    [
        ({"nodeSelector": {}}, "nodeSelector is empty"),
        ({"nodeSelector": {"gpu": "a"}, "maxNodes": 4}, "Karpenter NodePool spec.limits"),
        ({"nodeSelector": {"gpu": "a"}, "minNodes": 1}, "not supported"),
    ],
)
def test_pools_the_operator_refuses(pool: dict[str, Any], words: str) -> None:
    (problem,) = nodepool.pool_problems(pool)
    assert words in problem
    (refused,) = validate(spec(scheduler={"nodePool": "p"}), pool, "redis://r")
    assert refused.reason == "InvalidNodePool" and words in refused.message and "'p'" in refused.message


def test_node_counts_of_zero_from_older_charts_are_accepted_and_the_crd_says_so() -> None:
    assert nodepool.pool_problems({"nodeSelector": {"gpu": "a"}, "minNodes": 0, "maxNodes": 0}) == []
    pool_spec = crds.GPU_NODE_POOL_SPEC
    (rule,) = pool_spec["x-kubernetes-validations"]
    assert rule["message"] == nodepool.NODE_LIMITS_MESSAGE
    assert "self.maxNodes == 0" in rule["rule"] and "self.minNodes == 0" in rule["rule"]
    assert pool_spec["properties"]["nodeSelector"]["minProperties"] == 1
    assert pool_spec["properties"]["tolerations"]["items"]["properties"]["effect"]["enum"]
