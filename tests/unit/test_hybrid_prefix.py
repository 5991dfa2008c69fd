"""Prefix caching for hybrid models (memory/hybrid_cache.py, memory/states.py): a prefix is resumable
only up to a node holding a snapshot of the linear layers' recurrent state. The cache on its own
(matches, the bounded snapshot pool's LRU eviction, KV eviction, block events that report only
resumable prefixes, a property test of random operations), then an engine on a tiny Qwen3.5 that
resumes a 1,000-token prefix and computes only the suffix, with the tokens of a cold run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve import Engine, SamplingParams
from radixserve.common.block_hash import block_hashes, root_hash
from radixserve.scheduler.memory.hybrid_cache import HybridRadixCache
from radixserve.scheduler.memory.state_pool import StateShape, plan_state_memory
from tests.helpers.hf import one_thread
from tests.helpers.radix import make_hybrid_cache, put

BS = 4  # block size of the block events


def snap(cache: HybridRadixCache, tokens) -> int:
    """Take a snapshot where ``tokens`` end (as a step's settle does); returns its slot."""
    slot = cache.alloc_snapshot()
    assert slot is not None
    assert cache.attach(np.asarray(tokens, dtype=np.int32), slot)
    return slot


def check(cache: HybridRadixCache) -> None:
    """The snapshot pool's bound and owners, and every node's subtree count."""
    s = cache.snapshots
    free, held = s.free_slots(), set(cache.held)
    assert len(free) + len(held) == s.capacity and not set(free) & held
    nodes = cache.nodes()
    assert {n.snapshot for n in nodes if n.snapshot >= 0} == held
    for n in nodes:
        below = (n.snapshot >= 0) + sum(c.snaps_below for c in n.children.values())
        assert n.snaps_below == below


def test_match_returns_the_longest_prefix_with_both_kv_and_a_snapshot():
    c = make_hybrid_cache(snapshots=4)
    a = list(range(100, 140))
    put(c, a)
    m = c.match_prefix(np.array(a + [7]))
    assert len(m.slots) == 0 and m.node is c.root and m.branch == 40  # KV, but nothing to resume from
    snap(c, a[:16])
    snap(c, a[:32])
    m = c.match_prefix(np.array(a[:30] + [1, 2]))  # leaves the tree at 30: resumes at 16
    assert len(m.slots) == 16 and m.branch == 30
    assert m.node.snapshot >= 0 and m.node.depth + len(m.node) == 16
    assert len(c.match_prefix(np.array(a)).slots) == 32
    assert len(c.match_kv(np.array(a)).slots) == 40  # the plain KV match (the accounting check's)
    check(c)


def test_snapshot_pool_is_bounded_evicts_lru_and_never_a_locked_one():
    c = make_hybrid_cache(snapshots=2)
    a, b, d = list(range(10, 30)), list(range(40, 60)), list(range(70, 90))
    for x in (a, b, d):
        put(c, x)
    snap(c, a)
    snap(c, b)
    c.match_prefix(np.array(a))  # touches a: b is now the least recently used
    snap(c, d)
    assert len(c.match_prefix(np.array(b)).slots) == 0  # b's snapshot went, its KV stays
    assert len(c.match_kv(np.array(b)).slots) == 20
    assert len(c.match_prefix(np.array(a)).slots) == 20
    for node in list(c.held.values()):
        c.lock(node)
    assert c.alloc_snapshot() is None  # every snapshot locked: the step takes none
    for node in list(c.held.values()):
        c.unlock(node)
    check(c)


def test_kv_eviction_takes_unresumable_leaves_first_and_drops_a_snapshot_with_its_node():
    c = make_hybrid_cache(num_pages=64, snapshots=4)
    a, b = list(range(10, 30)), list(range(40, 60))
    put(c, a)
    put(c, b)
    snap(c, a)
    c.match_prefix(np.array(a))  # a is the most recently used; b goes first all the same
    assert c.evict(20) == 20
    assert len(c.match_kv(np.array(b)).slots) == 0 and len(c.match_prefix(np.array(a)).slots) == 20
    assert c.evict(20) == 20
    assert not c.held and c.snapshots.num_free == 4
    check(c)


def test_block_events_report_only_prefixes_that_can_be_resumed():
    c = make_hybrid_cache(num_pages=128, page_size=4, snapshots=4)
    c.enable_block_events(BS, root_hash("m"))
    a = np.arange(200, 240, dtype=np.int32)
    put(c, a)
    assert c.take_block_events() == []  # KV alone: nothing a request could resume
    snap(c, a[:16])
    held: set[int] = set()
    for kind, hashes in c.take_block_events():
        assert kind == "stored"
        held |= set(hashes)
    assert held == set(block_hashes(a[:16], "m", BS)) == set(c.all_block_hashes())
    snap(c, a)
    held |= {h for _, hs in c.take_block_events() for h in hs}
    assert held == set(block_hashes(a, "m", BS)) == set(c.all_block_hashes())
    c.drop_snapshot(c.match_prefix(a).node)  # the deeper snapshot goes: its blocks are withdrawn
    for kind, hashes in c.take_block_events():
        assert kind == "removed"
        held -= set(hashes)
    assert held == set(block_hashes(a[:16], "m", BS)) == set(c.all_block_hashes())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "snap", "match", "evict", "lock"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=12),
            st.integers(0, 40),
        ),
        max_size=40,
    )
)
def test_random_inserts_matches_and_evictions_keep_the_snapshot_bound_and_invariants(ops):
    """Short alphabets so prompts share prefixes; the pool of 3 snapshots overflows often."""
    c = make_hybrid_cache(num_pages=48, page_size=2, snapshots=3)
    c.enable_block_events(BS, root_hash("m"))
    held: set[int] = set()
    locked = []
    for op, toks, n in ops:
        tokens = np.array(toks + toks[:1] * (len(toks) % 2), dtype=np.int32)  # page aligned
        if op == "insert" and c.allocator.num_free_pages * 2 >= len(tokens):
            put(c, tokens)
        elif op == "snap":
            kv = c.match_kv(tokens)
            end = len(kv.slots) - len(kv.slots) % 2
            slot = c.alloc_snapshot() if end else None
            if slot is not None:
                c.attach(tokens[:end], slot)
        elif op == "match":
            m = c.match_prefix(tokens)
            assert len(m.slots) <= len(c.match_kv(tokens).slots)
            assert m.node is c.root or m.node.snapshot >= 0  # a resumable prefix ends at a snapshot
        elif op == "evict":
            c.evict(n)
        elif op == "lock":
            if locked:
                c.unlock(locked.pop())
            m = c.match_prefix(tokens)
            c.lock(m.node)
            locked.append(m.node)
        check(c)
        for kind, hashes in c.take_block_events():
            if kind == "stored":
                assert not held & set(hashes)
                held |= set(hashes)
            else:
                held -= set(hashes)
        assert held == set(c.all_block_hashes())  # the cluster index sees exactly the resumable blocks
    for node in locked:
        c.unlock(node)
    c.evict(c.evictable_size)
    assert c.allocator.num_free_pages == 48 and c.snapshots.num_free == 3 and not c.held


# ------------------------------------------------------------------- the engine, 1,000 tokens
@pytest.mark.parametrize("page", [1, 16])
def test_a_shared_1000_token_prefix_is_resumed_and_only_the_suffix_computed(demo_model, page):
    """Prefill chunks of 256: the first request leaves its KV, a snapshot at each chunk end and one
    at its prompt's end. Page 1: the second leaves the tree where the prefix ends (1000), resumes
    from the chunk end before it and snapshots there (its branch point); every later one resumes
    there and computes only its suffix. Page 16: the first's prompt-end snapshot (its last whole
    page, 992) already lies on the prefix. Every output is exactly a cold run's; the pools return
    to their free sizes."""
    path = demo_model("qwen3_5")
    rng = np.random.default_rng(0)
    prefix = rng.integers(10, 2000, 1000).tolist()
    suffixes = [rng.integers(10, 2000, 7 + i).tolist() for i in range(4)]
    prompts = [prefix + s for s in suffixes]
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    args = dict(max_total_tokens=4096, page_size=page, chunked_prefill_size=256, max_running_requests=4)
    with one_thread(), Engine(path, disable_radix_cache=True, **args) as cold:
        want = [o["token_ids"] for o in cold.generate(input_ids=prompts, sampling_params=greedy)]
    with one_thread(), Engine(path, **args) as engine:
        s = engine.scheduler
        computed = []
        for p, w in zip(prompts, want, strict=True):
            before = s.prefill_tokens
            out = engine.generate(input_ids=p, sampling_params=greedy)
            computed.append(s.prefill_tokens - before)
            assert out["token_ids"] == w
        if page == 1:
            # the second resumes at the first's last chunk end before the prefix ends (768) and
            # snapshots where it leaves the tree (1000), where every later one resumes
            assert computed[:2] == [len(prompts[0]), len(prompts[1]) - 768]
            assert computed[2:] == [len(p) - 1000 for p in prompts[2:]]
        else:  # the first's prompt-end snapshot (its last whole page, 992) already lies on the prefix
            assert computed == [len(prompts[0])] + [len(p) - 992 for p in prompts[1:]]
        kv, states = s.kv, s.kv.states
        kv.check([])
        assert kv.available() == kv.capacity and kv.req_to_token.num_free == 4
        assert states is not None and states.hybrid is not None and not states.in_flight
        kv.cache.evict(kv.capacity)
        assert states.hybrid.snapshots.num_free == states.hybrid.snapshots.capacity


def test_state_memory_comes_out_of_the_kv_pools_share_and_too_little_is_refused_in_one_line():
    shape = StateShape(layers=3, conv_dim=96, conv_width=3, heads=4, k_dim=16, v_dim=16)
    per_slot = shape.nbytes(torch.float32)
    assert per_slot == 3 * (96 * 3 * 4 + 4 * 16 * 16 * 4)
    snapshots, left = plan_state_memory(shape, torch.float32, 4, 10_000, 256)
    assert snapshots == 4 * 4  # a tenth of the memory holds more: at most four per row
    assert left == 10_000 - -(-(4 + 2 + snapshots) * per_slot // 256)  # rows, scratch, zeros, snapshots
    assert plan_state_memory(shape, torch.float32, 4, 10_000, 256, snapshots=0)[0] == 0
    with pytest.raises(ValueError, match=r"^the recurrent states of 64 running requests .* lower"):
        plan_state_memory(shape, torch.float32, 64, 1000, 256)


def test_a_request_longer_than_the_pools_hold_is_refused_and_the_engine_keeps_serving(demo_model):
    """The states come out of the memory the KV pool would have had: a prompt that fits the model's
    context but not what is left is refused in one line, like any over-long prompt."""
    path = demo_model("qwen3_5")
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    with Engine(path, max_total_tokens=256, page_size=16, max_running_requests=2) as engine:
        cap = engine.scheduler.kv.capacity
        assert cap == 256 and engine.placement["state_bytes_per_rank"] > 0
        refused = r"^prompt \(300 tokens\) \+ max_new_tokens \(4\) exceeds the KV capacity 256$"
        with pytest.raises(ValueError, match=refused):
            engine.generate(input_ids=list(range(10, 310)), sampling_params=greedy)
        assert len(engine.generate(input_ids=list(range(10, 50)), sampling_params=greedy)["token_ids"]) == 4
