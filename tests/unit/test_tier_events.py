"""Block events name the tier (docs/architecture.md, "KV tiers"): a host-tiered radix cache reports
each block at the best tier it holds it on (``stored``: the device, ``stored_host``), ``removed`` when
it leaves every tier, and a resync's snapshot says the same; the subscriber that carries them to a
gateway or Redis keeps the tier of each block's net effect."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.common.block_hash import block_hashes, root_hash
from radixserve.common.kv_tier import DEVICE, DISK, HOST
from radixserve.scheduler.kv_events import EventHub, EventSubscriber
from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.memory.tiered_cache import TieredRadixCache
from tests.helpers.radix import put, snapshot_blocks

BS, PS = 4, 4


def tiered(device_pages: int = 16, host_pages: int = 16) -> TieredRadixCache:
    cache = TieredRadixCache(
        PagedAllocator(device_pages, PS), ReqToTokenPool(4, 256), PagedAllocator(host_pages, PS)
    )
    cache.enable_block_events(BS, root_hash("m"))
    return cache


def load(cache: TieredRadixCache, tokens: list[int]) -> int:
    """A request's hit: its host part loaded back to the device (as KVCacheManager.admit does)."""
    m = cache.match_prefix(np.asarray(tokens, dtype=np.int32))
    cache.lock(m.node)
    got = cache.load_back(m)
    cache.unlock(m.node)
    cache.take_transfers()  # the step ran the copies
    return len(got.slots)


def replay(events: list[tuple[str, list[int]]], held: dict[int, str]) -> None:
    """What an index learns from the events: block -> the event that stored it last."""
    for kind, hashes in events:
        if kind == "cleared":
            held.clear()
        elif kind == "removed":
            assert set(hashes) <= held.keys(), "a block was removed that was not held"
            for h in hashes:
                del held[h]
        else:
            assert kind in ("stored", "stored_host"), kind
            held.update(dict.fromkeys(hashes, kind))


def test_a_block_moves_to_the_host_comes_back_and_leaves_and_the_events_say_so() -> None:
    cache = tiered()
    a = list(range(100, 116))  # 4 blocks
    h = block_hashes(a, "m", BS)
    put(cache, a)
    assert cache.take_block_events() == [("stored", h)]
    assert cache.evict(16) == 16  # written back: the node stays, on the host only
    assert cache.take_block_events() == [("stored_host", h)]
    assert snapshot_blocks(cache) == dict.fromkeys(h, "stored_host")  # a resync says the same
    assert load(cache, a) == 16
    assert cache.take_block_events() == [("stored", h)]
    assert snapshot_blocks(cache) == dict.fromkeys(h, "stored")
    cache.evict(16)  # its host copy is still there: the device copy just goes
    assert cache.take_block_events() == [("stored_host", h)]
    assert cache.evict_host(16) == 16  # the last tier: it leaves the tree
    assert cache.take_block_events() == [("removed", h)]
    assert snapshot_blocks(cache) == {}


def test_a_split_node_reports_the_tiers_of_its_parts() -> None:
    cache = tiered()
    a, b = list(range(100, 116)), [*range(100, 108), *range(300, 308)]  # share 2 blocks
    put(cache, a)
    cache.evict(16)
    put(cache, b)  # the shared part is taken back onto the device; a's tail stays on the host
    ha, hb = block_hashes(a, "m", BS), block_hashes(b, "m", BS)
    held: dict[int, str] = {}
    replay(cache.take_block_events(), held)
    expect = {**dict.fromkeys(ha[2:], "stored_host"), **dict.fromkeys(hb, "stored")}
    assert held == snapshot_blocks(cache) == expect


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "evict", "load", "evict_host"]),
            st.integers(0, 5),  # which conversation
            st.integers(1, 3),  # its length, in blocks (a longer one extends a shorter one)
        ),
        max_size=40,
    )
)
def test_replayed_events_are_always_the_snapshot_and_the_snapshot_the_tiers(ops) -> None:
    cache = tiered(device_pages=10, host_pages=8)
    convs = [[1000 * c + i for i in range(12)] for c in range(6)]
    held: dict[int, str] = {}
    for op, c, n in ops:
        tokens = convs[c][: n * BS]
        if op == "put" and cache.allocator.num_free_pages >= n:
            put(cache, tokens)
        elif op == "evict":
            cache.evict(n * PS)
        elif op == "load":
            load(cache, tokens)
        elif op == "evict_host":
            cache.evict_host(n * PS)
        cache.take_transfers()
        replay(cache.take_block_events(), held)
        snap = snapshot_blocks(cache)
        assert held == snap
        for node in cache.nodes():  # each block at the best tier its node is on
            want = "stored" if node.on_device else "stored_host"
            assert all(snap[x] == want for x in node.blocks)


def test_the_subscriber_keeps_each_blocks_last_tier_and_snapshots_carry_tiers() -> None:
    hub = EventHub()
    sub = hub.subscribe(EventSubscriber())
    hub.publish([], lambda: [("stored", [1, 2]), ("stored_host", [3]), ("stored_disk", [4])])
    got = sub.take(0)
    assert got is not None and got.cleared and got.removed == []
    assert dict(zip(got.stored, got.tiers, strict=True)) == {1: DEVICE, 2: DEVICE, 3: HOST, 4: DISK}
    hub.publish([("stored_host", [1]), ("stored", [3]), ("stored_disk", [1]), ("removed", [2])], list)
    got = sub.take(0)
    assert got is not None and not got.cleared and got.removed == [2]
    assert dict(zip(got.stored, got.tiers, strict=True)) == {1: DISK, 3: DEVICE}  # the net effect
    hub.publish([("stored", [5, 6])], list)
    assert sub.take(0) == (False, [5, 6], [], [])  # all on the device: no tiers (as before tiers)
    with pytest.raises(KeyError):
        sub.push([("stored_tape", [7])])  # an engine bug, loudly
