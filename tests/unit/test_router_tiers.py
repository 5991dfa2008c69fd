"""Tier-aware routing: the cache-aware router scores a pod's matched prefix as the sum of its
blocks' tier weights (device 1.0, host 0.8, disk 0.5 by default; --tier-weight-*), each block at the
best tier the pod can load it from, its shared disk directory's included, within the load guards."""

from __future__ import annotations

import pytest

from radixserve.common.config import ConfigError, load
from radixserve.common.config import parse_args as parse_flags
from radixserve.common.kv_tier import DISK, HOST, TierMatch, TierWeights
from radixserve.common.prefix_index import InMemoryPrefixIndex
from radixserve.common.rpc import pb
from radixserve.common.service_config import GatewayConfig
from radixserve.tokenizer.__main__ import RaisingParser, build_parser
from radixserve.tokenizer.routing.router import CacheAwareRouter
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle
from tests.helpers.routing import BS, MODEL, hashes_of, pod, tokens


def on_disk_dir(address: str, location: str, waiting: int = 0) -> SchedulerHandle:
    """A pod that mounts the shared disk directory ``location``."""
    return SchedulerHandle(address, healthy=True, load=pb.Load(waiting=waiting, disk_location=location))


def test_the_only_pod_holding_a_prefix_on_its_host_tier_is_chosen_over_one_with_none() -> None:
    index = InMemoryPrefixIndex()
    ids = tokens(1, 6)
    index.apply("a", hashes_of(ids), [], tiers=[HOST] * 6)  # evicted to a's host memory
    a, b = pod("a"), pod("b")
    router = CacheAwareRouter(index, MODEL, BS)
    for candidates in ([a, b], [b, a]):
        assert router.choose(ids, candidates) is a
        d = router.decisions[-1]
        assert (d.reason, d.matched_blocks, d.matched) == ("prefix", 6, TierMatch(host=6))
        assert d.score == pytest.approx(6 * 0.8)
    # with the host tier weighed at nothing, the prefix is as good as absent: a new prefix's routing
    nothing = CacheAwareRouter(index, MODEL, BS, tier_weights=TierWeights(1.0, 0.0, 0.0))
    nothing.choose(ids, [a, b])
    assert nothing.decisions[-1].reason == "no-match"


def test_a_device_hit_beats_a_host_hit_on_an_equally_loaded_pod() -> None:
    index = InMemoryPrefixIndex()
    ids = tokens(2, 6)
    h = hashes_of(ids)
    index.apply("a", h, [], tiers=[HOST] * 6)
    index.apply("b", h, [])  # on b's device
    a, b = pod("a", running=2), pod("b", running=2)
    router = CacheAwareRouter(index, MODEL, BS)
    for candidates in ([a, b], [b, a]):
        assert router.choose(ids, candidates) is b
        assert router.decisions[-1].matched == TierMatch(device=6)
    # a longer host hit is worth more than a short device one: 8 x 0.8 > 4 x 1.0 ...
    longer = tokens(3, 8)
    index.apply("a", hashes_of(longer), [], tiers=[HOST] * 8)
    index.apply("b", hashes_of(longer)[:4], [])
    assert router.choose(longer, [a, b]) is a
    # ... unless the host tier is weighed lower (--tier-weight-host 0.4: 3.2 < 4)
    low = CacheAwareRouter(index, MODEL, BS, tier_weights=TierWeights(1.0, 0.4, 0.2))
    assert low.choose(longer, [a, b]) is b
    # a pod's blocks count at the best tier it holds each on: 2 device + 4 host beats 6 host
    mixed = tokens(4, 6)
    index.apply("a", hashes_of(mixed), [], tiers=[HOST] * 6)
    index.apply("b", hashes_of(mixed), [], tiers=[0, 0, HOST, HOST, HOST, HOST])
    assert router.choose(mixed, [a, b]) is b
    assert router.decisions[-1].matched == TierMatch(device=2, host=4)


def test_every_pod_mounting_a_shared_disk_directory_can_be_routed_its_blocks() -> None:
    index = InMemoryPrefixIndex()
    ids = tokens(5, 6)
    # a wrote the prefix to the directory both a and b mount; c mounts another one
    index.apply("a", hashes_of(ids), [], tiers=[DISK] * 6, location="dir-1")
    a, b, c = on_disk_dir("a", "dir-1", waiting=3), on_disk_dir("b", "dir-1"), on_disk_dir("c", "dir-2")
    router = CacheAwareRouter(index, MODEL, BS)
    assert router.choose(ids, [a, b, c]) is b  # a and b can both load it: the less loaded
    d = router.decisions[-1]
    assert (d.reason, d.matched, d.score) == ("prefix", TierMatch(disk=6), pytest.approx(6 * 0.5))
    # a host hit on a busier pod still beats the directory, within the load guard
    index.apply("c", hashes_of(ids), [], tiers=[HOST] * 6)
    c.load = pb.Load(waiting=2, disk_location="dir-2")
    assert router.choose(ids, [a, b, c]) is c
    # ... and the guard still diverts from an overloaded holder (busy - min > 16 and > 1.5 x min)
    c.load = pb.Load(waiting=40, disk_location="dir-2")
    assert router.choose(ids, [a, b, c]) is b
    assert router.decisions[-1].reason == "balance"


def test_tier_weights_are_validated_with_the_flags_named() -> None:
    def gateway(*flags: str) -> GatewayConfig:
        return load(
            GatewayConfig,
            parse_flags(build_parser(RaisingParser), ["--model", "demo", "--schedulers", "a:1", *flags]),
        )

    cfg = gateway("--tier-weight-host", "0.6", "--tier-weight-disk", "0.1")
    assert cfg.routing.tier_weights() == TierWeights(1.0, 0.6, 0.1)
    with pytest.raises(ConfigError, match=r"--tier-weight-host=0\.9.*expected device >= host >= disk"):
        gateway("--tier-weight-device", "0.5", "--tier-weight-host", "0.9")
    with pytest.raises(ConfigError, match="--tier-weight-disk"):
        gateway("--tier-weight-disk", "1.5")
    with pytest.raises(ValueError, match=r"--tier-weight-device=-0\.1: expected a weight in"):
        TierWeights(-0.1, 0.0, 0.0)
