"""The host KV tier with a hybrid model (memory/hybrid_tiered_cache.py): a node keeps its state snapshot
when its KV goes to the host, so a host-only prefix with a snapshot is resumable: a hit loads its KV
back and the request's state starts from that snapshot.

The cache alone (matches that end at a snapshot on either tier, evictions on both tiers, a load the
device cannot hold, block events by tier, a property test of random operations with the KV each tier
holds checked), the scheduler with the echo runner (whose fake states fail a request resumed from
the wrong snapshot), and an engine on the tiny generated Qwen3.5: greedy tokens of tiers off, prefixes
served by loads from the host, every pool free after; the disk tier refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.common.block_hash import block_hashes, root_hash
from radixserve.scheduler.memory.hybrid_cache import has_snapshot
from radixserve.scheduler.memory.hybrid_tiered_cache import HybridTieredCache
from radixserve.scheduler.memory.radix_cache import TreeNode
from tests.helpers.host_tier import PREFIX, engine_turns, hybrid_cache, hybrid_kv
from tests.helpers.radix import put, snapshot_blocks
from tests.helpers.scheduler import (
    make_req,
    path_tokens,
    reference_output,
    run_to_completion,
    runner_for,
    sched,
)

PAGE = 4


def _snap(cache: HybridTieredCache, tokens) -> TreeNode:
    """A snapshot where ``tokens`` end (as a step's settle takes one); returns its node."""
    slot = cache.alloc_snapshot()
    assert slot is not None and cache.attach(np.asarray(tokens, dtype=np.int32), slot)
    return cache.held[slot]


def _ids(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])


def test_a_snapshot_stays_with_its_node_on_the_host_and_a_hit_resumes_from_it():
    kv = hybrid_kv(snapshots=2)
    cache = hybrid_cache(kv)
    a = np.arange(100, 132, dtype=np.int32)
    put(cache, a)
    first, second = _snap(cache, a[:16]), _snap(cache, a)
    assert cache.evict(16) == 16  # the leaf a[16:32] goes to the host, its snapshot with it
    assert not second.on_device and second.on_host and second.snapshot >= 0
    m = cache.match_prefix(_ids(a, [7]))
    assert len(m.slots) == 16 and m.node is first  # the device part ...
    assert m.host_node is second and m.host_len == 16 and m.branch == 32  # ... and the host part
    leaves = cache.match_prefix(_ids(a[:28], [1, 2, 3, 4]))  # leaves in the host part, before a snapshot
    assert len(leaves.slots) == 16 and leaves.host_node is None and leaves.branch == 28
    kv.check(())

    req = make_req("r", _ids(a, [7]).tolist())
    kv.admit(req, kv.match(req))  # loads the host part back; the state starts from its snapshot
    assert req.cached_len == 32 and req.loaded_len == 16 and req.last_node is second
    assert req.state_src == second.snapshot and req.branch_len == 32 and second.lock_ref == 1
    t, owners = kv.take_transfers([req])
    assert req.req_pool_idx is not None and t is not None and owners == [(req, 16)]
    assert np.array_equal(t.load_dst, kv.req_to_token.read(req.req_pool_idx, 16, 32))
    kv.check([req])
    assert cache.alloc_snapshot() is None  # the request locks the snapshot it starts from (and above)
    kv.release(req)
    kv.check(())
    slot = cache.alloc_snapshot()  # unlocked now: the pool's LRU may take one
    assert slot is not None and len(cache.held) == 1
    cache.snapshots.free(slot)
    kv.check(())


def test_device_eviction_writes_back_only_what_can_be_resumed_and_a_node_leaving_drops_its_snapshot():
    kv = hybrid_kv(device=64, host=32)
    cache = hybrid_cache(kv)
    plain, b, a = (np.arange(s, s + n, dtype=np.int32) for s, n in ((10, 16), (40, 16), (70, 32)))
    put(cache, plain)
    cache.evict(16)  # no snapshot at or below it: no request could resume from it on the host
    assert cache.written_back_tokens == 0 and cache.host_size == 0 and not cache.root.children
    put(cache, b)
    node_b = _snap(cache, b)
    cache.evict(16)
    assert node_b.on_host and not node_b.on_device and node_b.snapshot >= 0 and cache.host_size == 16
    put(cache, a)
    _snap(cache, a)
    cache.evict(32)  # the host makes room: b, a host-only leaf, leaves the tree with its snapshot
    assert cache.match_prefix(b).length == 0 and node_b.snapshot < 0
    assert cache.match_prefix(_ids(a, [1])).host_len == 32 and len(cache.held) == 1
    kv.check(())
    cache.evict_host(32)  # a leaves the tree: every snapshot slot is free again
    assert not cache.held and cache.snapshots.num_free == cache.snapshots.capacity
    assert kv.host is not None and kv.host.free_tokens == kv.host.capacity_tokens
    kv.check(())


def test_host_eviction_takes_nodes_without_a_snapshot_first():
    kv = hybrid_kv(device=64, host=64)
    cache = hybrid_cache(kv)
    x, y = np.arange(10, 26, dtype=np.int32), np.arange(40, 56, dtype=np.int32)
    for seq in (x, y):  # x is the least recently used
        put(cache, seq)
        _snap(cache, seq)
        cache.evict(16)
    node_y = cache.match_kv(y).host_node
    assert node_y is not None and node_y.snapshot >= 0
    cache.drop_snapshot(node_y)  # the snapshot pool's LRU took y's
    assert cache.evict_host(16) == 16
    assert cache.match_kv(y).length == 0 and cache.match_prefix(_ids(x, [1])).host_len == 16
    kv.check(())


def test_a_load_the_device_cannot_hold_falls_back_to_the_resumable_part_of_the_device_part():
    kv = hybrid_kv(device=32, host=64)
    cache = hybrid_cache(kv)
    a = np.arange(100, 132, dtype=np.int32)
    put(cache, a)
    top, end = _snap(cache, a[:4]), _snap(cache, a)
    cache.match_prefix(_ids(a[:8], [1, 1, 1, 1]))  # splits at 8: no snapshot there
    cache.evict(24)  # a[8:32] to the host
    locked = put(cache, np.arange(200, 224, dtype=np.int32)).node
    cache.lock(locked)  # the device is full of pages nothing can evict
    req = make_req("r", _ids(a, [7]).tolist())
    m = kv.match(req)
    assert len(m.slots) == 8 and m.host_node is end and m.host_len == 24
    assert not kv.start_load(req, m)  # no room: nothing loaded, nothing left locked
    assert m.node.lock_ref == top.lock_ref == 0 and cache.loaded_tokens == 0
    kv.admit(req, m)  # (what a pass that does not wait for loads does): it resumes at 4, not 8
    assert req.cached_len == 4 and req.last_node is top and req.state_src == top.snapshot
    kv.unadmit(req)
    cache.unlock(locked)
    kv.check(())


def test_block_events_follow_the_resumable_blocks_across_tiers():
    kv = hybrid_kv(device=64, host=64)
    cache = hybrid_cache(kv)
    cache.enable_block_events(PAGE, root_hash("m"))
    a = np.arange(300, 316, dtype=np.int32)
    blocks = list(block_hashes(a, "m", PAGE))
    put(cache, a)
    assert cache.take_block_events() == []  # KV alone: nothing to resume
    node = _snap(cache, a)
    assert cache.take_block_events() == [("stored", blocks)]
    cache.evict(16)
    assert cache.take_block_events() == [("stored_host", blocks)]
    assert snapshot_blocks(cache) == dict.fromkeys(blocks, "stored_host")
    cache.drop_snapshot(node)  # the snapshot pool's LRU takes it: the blocks are withdrawn ...
    assert cache.take_block_events() == [("removed", blocks)] and snapshot_blocks(cache) == {}
    node = _snap(cache, a)  # ... and come back with a new snapshot, at the tier that holds them
    assert cache.take_block_events() == [("stored_host", blocks)]
    req = make_req("r", _ids(a, [1]).tolist())
    kv.admit(req, kv.match(req))
    assert cache.take_block_events() == [("stored", blocks)]  # loaded back
    kv.release(req)
    cache.evict(16, write_back=False)  # its host copy is still there: back to the host only
    assert cache.take_block_events() == [("stored_host", blocks)]
    cache.evict_host(16)
    assert cache.take_block_events() == [("removed", blocks)] and node.snapshot < 0
    assert cache.block_snapshot() == [] and not cache.held
    kv.check(())


STEMS = [list(range(1, 25)), list(range(40, 52)), [3, 1, 4, 1, 5, 9, 2, 6] * 2]
STEPS = st.lists(
    st.tuples(
        st.sampled_from(STEMS),
        st.lists(st.integers(60, 66), max_size=10),
        st.sampled_from([None, 0.5, 1.0]),  # where the request snapshots: nowhere, half way, its end
        st.integers(0, 40),  # device tokens evicted after it
        st.sampled_from([0, 0, 0, 4, 16]),  # host tokens evicted after it (write-backs evict too)
        st.booleans(),  # the snapshot pool's LRU takes one
    ),
    min_size=4,
    max_size=16,
)


class _Tiers:
    """The cache with fake device and host KV pools that run its copies, fake state snapshots on both
    tiers (a slot's "state" is the tokens it was taken after), and the block events seen."""

    def __init__(self, page: int, pages: int, host_pages: int, snapshots: int, host_snaps: int = 0) -> None:
        self.kv = hybrid_kv(pages * page, host_pages * page, snapshots, page, host_snaps)
        self.states: dict[int, tuple[int, ...]] = {}  # device snapshot slot -> tokens
        self.host_states: dict[int, tuple[int, ...]] = {}  # host snapshot slot -> tokens
        self.cache = hybrid_cache(self.kv)
        self.cache.enable_block_events(page, root_hash("m"))
        assert self.kv.host is not None
        self.dev = np.full(self.kv.allocator.pool_slots, -1, dtype=np.int64)
        self.host = np.full(self.kv.host.pool_slots, -1, dtype=np.int64)
        self.events: dict[int, str] = {}
        self.loads = 0  # matches with a host part the device took back

    def request(self, seq: np.ndarray) -> TreeNode:
        """A request for ``seq``: its resumable prefix loaded back, the rest computed and handed to
        the tree (which keeps its own copies, and gives host-only nodes the new pages); returns the
        node it locks."""
        c, alloc = self.cache, self.kv.allocator
        m = c.match_prefix(seq)
        kv = c.match_kv(seq)
        end = m.host_node or m.node
        assert end is c.root or has_snapshot(end), "a match that ends without a snapshot"
        assert m.length <= kv.length == m.branch
        c.lock(m.node)
        loaded = c.load_back(m)
        c.lock(loaded.node)
        c.unlock(m.node)
        assert loaded.host_node is None and (loaded.node is c.root or loaded.node.snapshot >= 0)
        if len(loaded.slots) > len(m.slots):  # loaded: the match up to its snapshot, on the device
            assert loaded.node is m.host_node and len(loaded.slots) == m.length
            self.loads += 1
        have = len(loaded.slots)
        need = (len(seq) - have) // c.page_size
        if need > alloc.num_free_pages:
            c.evict((need - alloc.num_free_pages) * c.page_size)
        self.run_copies()  # the step's copies, before its forward
        assert np.array_equal(self.dev[loaded.slots], seq[:have]), "loaded the wrong KV"
        if have:  # the request's state starts from the snapshot where its match ends
            assert self.states[loaded.node.snapshot] == tuple(seq[:have].tolist()), "resumed the wrong state"
        if not need or alloc.num_free_pages < need:
            return loaded.node
        slots = np.concatenate([loaded.slots, alloc.pages_to_slots(alloc.alloc_pages(need))])
        self.dev[slots[have:]] = seq[have:]  # the forward
        res = c.insert(seq, slots)
        alloc.free_slots(slots[have : res.present_len])  # duplicates of what the tree holds
        c.lock(res.node)
        c.unlock(loaded.node)
        return res.node

    def snapshot(self, tokens: np.ndarray) -> None:
        """A step's cut after ``tokens`` (page aligned), then handed to the tree (settle)."""
        slot = self.cache.alloc_snapshot()
        if slot is None:
            return
        self.run_copies()  # the step's stores read the evicted slot before its forward writes it
        self.states[slot] = tuple(tokens.tolist())
        self.cache.attach(tokens, slot)  # (not when that prefix is not cached: the slot is freed)

    def run_copies(self) -> None:
        t = self.cache.take_transfers()
        if t is not None:
            self.host[t.store_dst] = self.dev[t.store_src]
            self.dev[t.load_dst] = self.host[t.load_src]
        stores, loads = self.cache.take_state_transfers()  # stores, then loads
        for pairs, src, dst in (
            (stores, self.states, self.host_states),
            (loads, self.host_states, self.states),
        ):
            a, b = np.split(pairs, 2)
            for x, y in zip(a.tolist(), b.tolist(), strict=True):
                dst[y] = src[x]

    def check(self) -> None:
        self.kv.check(())
        for kind, hashes in self.cache.take_block_events():
            for h in hashes:
                if kind == "removed":
                    del self.events[h]
                else:
                    self.events[h] = kind
        assert self.events == snapshot_blocks(self.cache)  # the index sees the resumable blocks, by tier
        self.run_copies()
        for node in self.cache.nodes():
            if node.on_device:
                assert np.array_equal(self.dev[node.value], node.key), "device KV is not its tokens"
            if node.on_host:
                assert np.array_equal(self.host[node.host_value], node.key), "host KV is not its tokens"
            path = tuple(path_tokens(node))
            if node.snapshot >= 0:
                assert self.states[node.snapshot] == path, "a snapshot is not its node's"
            if node.host_snapshot >= 0:
                assert self.host_states[node.host_snapshot] == path, "a host snapshot is not its node's"


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from([1, 2, 4]),
    st.integers(8, 24),
    st.integers(4, 40),
    st.integers(1, 6),
    st.sampled_from([0, 0, 1, 3, 8]),
    STEPS,
)
def test_random_requests_keep_both_tiers_and_the_snapshots_consistent(
    page, pages, host_pages, snaps, host_snaps, steps
):
    """Requests on prefixes that share stems, each followed by evictions on either tier and maybe a
    snapshot taken by the pool's LRU; with ``host_snaps``, snapshots the device pool evicts go to host
    slots and come back. After each: the accounting over both tiers and both snapshot pools
    (KVCacheManager.check), the KV each tier holds and each snapshot on either tier is its node's
    tokens, a match ends at a snapshot, a load brings the right KV and state, and the block events
    seen are the cache's snapshot."""
    t = _Tiers(page, pages, host_pages, snaps, host_snaps)
    c = t.cache
    for stem, tail, cut, evict, evict_host, drop in steps:
        seq = np.array(stem + tail, dtype=np.int32)
        seq = seq[: len(seq) - len(seq) % page]
        node = t.request(seq)
        at = 0 if cut is None else int(len(seq) * cut) // page * page
        if at:
            t.snapshot(seq[:at])
        c.unlock(node)
        c.evict(evict)
        c.evict_host(evict_host)
        if drop and host_snaps:  # others' snapshots take every device slot: the pool's LRU evicts
            taken = []
            while (slot := c.alloc_snapshot()) is not None:
                taken.append(slot)
            t.run_copies()  # (their step's stores, before anything writes the slots)
            for slot in taken:
                c.snapshots.free(slot)
        elif drop and c.held:
            c.drop_snapshot(min(c.held.values(), key=lambda n: (n.last_access, n.id)))
        t.check()
    c.evict(c.evictable_size)
    c.evict_host(c.host_size)
    t.check()
    assert not c.nodes() and c.snapshots.num_free == snaps and not c.host_held
    assert t.kv.host is not None and t.kv.host.free_tokens == t.kv.host.capacity_tokens


# ------------------------------------------------------------ the scheduler, with the echo runner
def _two_rounds(host: int):
    """Six conversations, two turns each, through a device pool that holds about two of them. Each
    first turn takes a snapshot at every chunk end (8 tokens) and where its prompt ends: 32 snapshot
    slots keep every conversation's last one (with 16, the pool's LRU takes most of them before the
    second turns, whatever the tier holding their KV: 16 tokens loaded from the host, not 240)."""
    s = sched(total=160, page=4, host=host, snapshots=32, chunked_prefill_size=8, min_new_token_ratio=0.0)
    convs = [[1000 + 100 * c + i for i in range(PREFIX)] for c in range(6)]
    outputs = {}
    for turn in range(2):
        for c, prefix in enumerate(convs):
            s.add(make_req(f"c{c}t{turn}", [*prefix, 7 + turn, 9 + c], max_new=12, t=float(10 * turn + c)))
        for r in run_to_completion(s):  # the invariants, every KV and every state, at every step
            outputs[r.rid] = r.output_ids
            assert r.output_ids == reference_output(r.origin_ids.tolist(), 12), r.rid
    return s, outputs


def test_scheduler_resumes_prefixes_loaded_from_the_host_from_their_snapshots():
    off, out_off = _two_rounds(0)
    on, out_on = _two_rounds(2048)
    assert out_on == out_off
    assert runner_for(on).loaded > 0 and on.kv.hit_tokens["host"] > 0
    assert on.prefill_tokens <= off.prefill_tokens - 3 * PREFIX
    kv, cache = on.kv, hybrid_cache(on.kv)
    kv.check(())
    assert kv.available() == kv.capacity and kv.req_to_token.num_free == kv.req_to_token.max_running
    cache.evict(kv.capacity)
    cache.evict_host(cache.host_size)
    assert kv.allocator.free_tokens == kv.capacity and cache.host_size == 0
    assert cache.snapshots.num_free == cache.snapshots.capacity and not cache.copies


# ------------------------------------------------------------------- the engine, tiny Qwen3.5
@pytest.fixture(scope="module")
def qwen_dir(demo_model):
    return demo_model("qwen3_5")


@pytest.fixture(scope="module")
def tiers_off(qwen_dir):
    return engine_turns(qwen_dir, host_kv_cache_gb=0.0)


@pytest.mark.parametrize("defer", [None, True], ids=["cpu-default", "loads-waited-for"])
def test_engine_greedy_tokens_are_the_same_with_the_host_tier_on_and_off(qwen_dir, tiers_off, defer):
    """``loads-waited-for``: a request whose prefix is on the host waits a step for its load (as on
    CUDA), then resumes from the snapshot; CPU's default admits it in the step of its load."""
    off, s_off = tiers_off
    on, s_on = engine_turns(qwen_dir, defer_host_loads=defer, host_kv_cache_gb=0.01)
    assert [[o["token_ids"] for o in t] for t in on] == [[o["token_ids"] for o in t] for t in off]
    hits_on = sum(o["meta_info"]["cached_tokens"] for o in on[1])
    hits_off = sum(o["meta_info"]["cached_tokens"] for o in off[1])
    assert hits_on >= hits_off + 3 * PREFIX  # the second turns' prefixes came back from the host
    assert s_on.kv.cache.loaded_tokens >= 3 * PREFIX and s_on.kv.hit_tokens["host"] >= 3 * PREFIX
    assert s_on.prefill_tokens < s_off.prefill_tokens
    kv, cache = s_on.kv, hybrid_cache(s_on.kv)
    assert kv.req_to_token.num_free == kv.req_to_token.max_running and not cache.copies
    cache.evict(kv.capacity)
    cache.evict_host(cache.host_size)
    assert kv.host is not None and kv.host.free_tokens == kv.host.capacity_tokens
    assert kv.allocator.free_tokens == kv.capacity
    assert cache.snapshots.num_free == cache.snapshots.capacity


def test_the_disk_tier_is_refused_with_a_hybrid_model_by_name(qwen_dir, tmp_path):
    from radixserve import Engine

    refused = r"^kv_disk_cache_dir: the disk KV tier does not serve hybrid models \(its files hold KV blocks"
    with pytest.raises(ValueError, match=refused):
        Engine(qwen_dir, max_total_tokens=256, host_kv_cache_gb=0.01, kv_disk_cache_dir=str(tmp_path),
               warmup=False)  # fmt: skip
    assert not any(tmp_path.iterdir())  # refused before the directory was opened
