"""The prefix index keeps a tier per (block, holder), both backends (in-memory, and Redis on a real
redis-server): a pod's blocks at the best tier it holds them on, a shared disk directory's blocks
under the directory (one location: every pod mounting it can load them), and ``match_tiers``
counts each pod's leading blocks by the best tier it can load each from."""

from __future__ import annotations

import logging

import pytest

from radixserve.common.kv_tier import DEVICE, DISK, HOST, TierMatch
from radixserve.common.prefix_index import InMemoryPrefixIndex
from tests.helpers.prefix_index import Backend, backend_fixture, hashes_of, prompt  # noqa: F401
from tests.redis_server import redis_server_fixture  # noqa: F401


def test_each_pod_holds_each_block_at_a_tier_and_moves_between_tiers(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(1, 6))
    idx.apply("a", h, [])  # no tiers: on the device (what a pod from before tiers sends)
    idx.apply("b", h[:4], [], tiers=[DEVICE, DEVICE, HOST, HOST])
    assert idx.match_tiers(h) == {"a": TierMatch(device=6), "b": TierMatch(device=2, host=2)}
    assert idx.match(h) == {"a": 6, "b": 4}  # leading blocks on any tier
    idx.apply("b", h[2:3], [], tiers=[DEVICE])  # loaded back
    idx.apply("a", h[4:], [], tiers=[HOST, HOST])  # written back
    assert idx.match_tiers(h) == {"a": TierMatch(device=4, host=2), "b": TierMatch(device=3, host=1)}
    idx.apply("b", [], h[3:4])  # left its last tier
    assert idx.match_tiers(h) == {"a": TierMatch(device=4, host=2), "b": TierMatch(device=3)}
    idx.apply("a", h[:1], [], cleared=True, tiers=[HOST])  # a resync: cleared + a snapshot by tier
    assert idx.match_tiers(h) == {"a": TierMatch(host=1), "b": TierMatch(device=3)}
    assert idx.num_blocks("a") == 1


def test_a_shared_disk_directory_is_one_location_every_pod_mounting_it_loads_from(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(2, 5))
    mounts = {"w": "dir-1", "r": "dir-1", "x": "dir-2"}
    idx.apply("w", h, [], tiers=[DEVICE, DISK, DISK, DISK, DISK], location="dir-1")
    idx.apply("r", h[:1], [], tiers=[HOST], location="dir-1")  # r holds block 0 itself, on its host
    assert idx.match_tiers(h, mounts) == {
        "w": TierMatch(device=1, disk=4),
        "r": TierMatch(host=1, disk=4),  # its own tier where better, the directory's after
    }
    # the directory is no pod: without the mounts (or to a pod of another directory) it is not matched
    assert idx.match_tiers(h) == {"w": TierMatch(device=1), "r": TierMatch(host=1)}
    assert idx.match(h) == {"w": 1, "r": 1}
    # the writer's resync (cleared) drops its own entries; the directory's files stay
    idx.apply("w", [], [], cleared=True, location="dir-1")
    assert idx.match_tiers(h, mounts) == {"r": TierMatch(host=1, disk=4)}
    # a block the writer reported on disk and then removed: its file went, for every pod
    idx.apply("w", h[3:], [], tiers=[DISK, DISK], location="dir-1")
    idx.apply("w", [], h[4:], location="dir-1")
    assert idx.match_tiers(h, mounts) == {"r": TierMatch(host=1, disk=3)}  # w lacks block 0: no match
    # a block loaded back onto a pod's device: its own entry, the directory keeps its copy
    idx.apply("w", h[3:4], [], tiers=[DEVICE], location="dir-1")
    assert idx.match_tiers(h, mounts)["r"] == TierMatch(host=1, disk=3)
    assert idx.match_tiers(h[1:], mounts) == {"w": TierMatch(device=1, disk=2), "r": TierMatch(disk=3)}


def test_a_pod_whose_disk_is_its_own_holds_its_disk_blocks_itself(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(3, 3))
    idx.apply("p", h, [], tiers=[DEVICE, HOST, DISK])  # no location: a disk nobody else mounts
    assert idx.match_tiers(h, {"q": "dir-9"}) == {"p": TierMatch(device=1, host=1, disk=1)}
    idx.apply("p", [], h[2:])
    assert idx.match_tiers(h) == {"p": TierMatch(device=1, host=1)}


def test_bad_tiers_and_locations_are_logged_and_read_as_the_device_or_the_pod(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    idx = backend.index
    h = hashes_of(prompt(4, 3))
    with caplog.at_level(logging.WARNING, "radixserve.common.prefix_index"):
        idx.apply("a", h, [], tiers=[HOST])  # not one per block: all on the device
        idx.apply("b", h, [], tiers=[HOST, 7, "disk"])  # unknown tiers: the device
        idx.apply("c", h, [], tiers=[DISK] * 3, location="two words")  # a location keys cannot hold
    assert idx.match_tiers(h, {"c": "two words"}) == {
        "a": TierMatch(device=3),
        "b": TierMatch(device=2, host=1),
        "c": TierMatch(disk=3),  # its disk taken as its own
    }
    text = caplog.text
    assert "1 tiers for 3 blocks of a" in text and "unknown tier(s) of b" in text and "disk location" in text
    with pytest.raises(ValueError, match="not starting with '@'"):
        idx.apply("@dir-1", h, [])  # a pod may not pose as a location


def test_in_memory_a_directorys_blocks_go_with_the_last_pod_that_mounts_it() -> None:
    idx = InMemoryPrefixIndex()
    h = hashes_of(prompt(5, 2))
    mounts = {"r": "dir-1", "new": "dir-1"}  # w is gone by the lookups
    idx.apply("w", h, [], tiers=[DISK, DISK], location="dir-1")
    idx.apply("r", [], [], location="dir-1")
    idx.remove_pod("w")  # r still mounts it: the files are still there for r
    assert idx.match_tiers(h, mounts) == {"r": TierMatch(disk=2), "new": TierMatch(disk=2)}
    idx.remove_pod(
        "r"
    )  # nobody that reported under it is left: forgotten (a pod's snapshot brings them back)
    assert idx.match_tiers(h, mounts) == {}


def test_a_pod_gone_before_it_wrote_a_block_to_its_shared_disk_is_removed(backend: Backend) -> None:
    idx = backend.index
    h = hashes_of(prompt(6, 2))
    idx.apply("p", h, [], tiers=[DEVICE, HOST], location="dir-3")  # nothing on its disk yet
    idx.remove_pod("p")  # the router's watch of a pod that went down, or a sweep
    assert idx.match_tiers(h, {"p": "dir-3"}) == {}
