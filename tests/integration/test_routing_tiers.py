"""Tier-aware routing across real processes: a gateway and two schedulers with a host KV tier. A
prefix that one scheduler's device pool evicted to its host tier is routed back to that scheduler
(it alone holds it, at the host tier's weight), which serves it from its host memory."""

from __future__ import annotations

import grpc
import httpx

from radixserve.common.block_hash import block_hashes
from radixserve.common.kv_tier import DEVICE, HOST
from radixserve.common.rpc import pb, pb_grpc
from radixserve.launcher import counter_by
from tests.helpers.cluster import MODEL_NAME, start_cluster

PREFIX = 160  # 10 blocks of 16


def complete(cluster, prompt: list[int]) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def held_on_each_pod(cluster, ids: list[int]) -> list[int]:
    """Tokens of ``ids`` each pod's cache holds, on any tier."""
    out = []
    for s in cluster.schedulers:
        with grpc.insecure_channel(s.grpc_address) as ch:
            reply = pb_grpc.SchedulerStub(ch).MatchPrefix(pb.MatchPrefixRequest(input_ids=ids), timeout=10)
            out.append(reply.cached_tokens)
    return out


def tiers_on(address: str, ids: list[int]) -> list[int | None]:
    """The tier of each of ``ids``' blocks in a pod's Watch snapshot (None: not held)."""
    with grpc.insecure_channel(address) as ch:
        stream = pb_grpc.SchedulerStub(ch).Watch(pb.WatchRequest(kv_events=True), timeout=30)
        first = next(u for u in stream if u.cleared)  # the snapshot
        stream.cancel()
    tiers = list(first.tiers) or [DEVICE] * len(first.stored)
    held = dict(zip(first.stored, tiers, strict=True))
    return [held.get(h) for h in block_hashes(ids, first.model_name, first.block_size)]


def test_a_prefix_evicted_to_one_pods_host_tier_is_routed_back_to_it(model_dir):
    cluster = start_cluster(
        model_dir,
        schedulers=2,
        router="cache-aware",
        # a device pool of about one prompt, a host tier of many
        scheduler_args=["--max-total-tokens", "256", "--page-size", "16", "--host-kv-cache-gb", "0.05"],
        gateway_args=["--recent-ttl", "0"],  # routed by what the pods report alone
    )
    try:
        system = [100 + (i % 90) for i in range(PREFIX)]
        assert complete(cluster, [*system, 2000])["prompt_tokens_details"]["cached_tokens"] == 0
        holder = [n >= PREFIX for n in held_on_each_pod(cluster, system)].index(True)
        # other prompts, each its own prefix, spread over both pods: the holder's device evicts the
        # system prompt, written back to its host tier
        for k in range(8):
            complete(cluster, [300 + 100 * k + (i % 90) for i in range(PREFIX)])
        assert held_on_each_pod(cluster, system)[holder] >= PREFIX  # still held, on some tier
        # the holder's Watch stream (what the gateway reads) says: on its host tier
        assert tiers_on(cluster.schedulers[holder].grpc_address, system) == [HOST] * (PREFIX // 16)
        metrics = f"{cluster.url}/metrics"
        before = counter_by(metrics, "radixserve_router_matched_blocks", "tier")
        usage = complete(cluster, [*system, 2001])
        after = counter_by(metrics, "radixserve_router_matched_blocks", "tier")
        # routed for its host-tier hit, to the pod that holds it, which loaded it back
        assert after.get("host", 0) - before.get("host", 0) >= 1, (before, after)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= PREFIX
        assert held_on_each_pod(cluster, system)[1 - holder] == 0  # the other pod never computed it
    finally:
        cluster.stop(drain_timeout=2)
