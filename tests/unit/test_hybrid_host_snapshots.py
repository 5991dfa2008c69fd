"""Host snapshot slots under the device's (memory/hybrid_tiered_cache.py, memory/host_state_pool.py): a
snapshot the device pool's LRU evicts is written back to a host slot, a node with a snapshot on
either tier is resumable, and a request admitted at a host-only snapshot gets it back in a device slot
before its ``inits`` copy reads it.

The cache and the real state pools on CPU (a snapshot resumed from the host holds what the device
held; the copies' order within a step: stores, loads, copies, inits; a store from a row whose copy
had not run; a store into a host slot dropped meanwhile; a load with every device snapshot locked;
a host slot a queued load reads kept), a property test of random conversations through the
scheduler with the echo runner (whose fake states fail any wrong resume), and an engine on the tiny
generated Qwen3.5: greedy tokens of tiers off, more prompt tokens from the host than without host
snapshots, every pool free after.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.scheduler.memory.host_state_pool import HostStatePool
from radixserve.scheduler.memory.hybrid_tiered_cache import HybridTieredCache
from radixserve.scheduler.memory.manager import KVCacheManager
from radixserve.scheduler.memory.radix_cache import TreeNode
from radixserve.scheduler.memory.state_pool import StatePool, StateShape, plan_host_states
from radixserve.scheduler.model.linear_attention import LinearStep
from radixserve.scheduler.model.linear_kernels import TorchDeltaRule
from radixserve.scheduler.model.state_step import run_copies
from tests.helpers.host_tier import PREFIX, engine_turns, hybrid_cache, hybrid_kv
from tests.helpers.radix import put
from tests.helpers.scheduler import make_req, reference_output, run_to_completion, runner_for, sched, step

PAGE = 4
ROWS = 4
SHAPE = StateShape(layers=2, conv_dim=3, conv_width=2, heads=2, k_dim=2, v_dim=2)


def _kv(snapshots: int = 1, host_snapshots: int = 2) -> KVCacheManager:
    return hybrid_kv(snapshots=snapshots, host_snapshots=host_snapshots, page=PAGE)


def _snap(cache: HybridTieredCache, tokens: np.ndarray) -> TreeNode:
    slot = cache.alloc_snapshot()
    assert slot is not None and cache.attach(tokens, slot)
    return cache.held[slot]


def _ids(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])


class _Pools:
    """The real StatePool and HostStatePool (CPU) of a ``_kv`` manager, each slot filled with its own
    values; ``run`` runs a StatePlan's arrays in the runner's order (model/state_step.py)."""

    def __init__(self, kv: KVCacheManager) -> None:
        cache = hybrid_cache(kv)
        assert cache.host_snapshots is not None
        self.dev = StatePool(SHAPE, ROWS, cache.snapshots.capacity, torch.float32, torch.device("cpu"))
        self.host = HostStatePool(SHAPE, cache.host_snapshots.capacity, torch.float32, torch.device("cpu"))
        for t in (*self.dev.conv, *self.dev.delta):
            t.copy_(torch.arange(t.shape[0], dtype=torch.float32).view(-1, *[1] * (t.dim() - 1)).expand_as(t))
        for t in (*self.host.conv, *self.host.delta):
            t.fill_(-1.0)

    def state(self, slot: int) -> list[torch.Tensor]:
        return [t[slot].clone() for t in (*self.dev.conv, *self.dev.delta)]

    def host_state(self, slot: int) -> list[torch.Tensor]:
        return [t[slot].clone() for t in (*self.host.conv, *self.host.delta)]

    def run(self, kv: KVCacheManager, inits: np.ndarray | None = None) -> None:
        cache = hybrid_cache(kv)
        stores, loads = cache.take_state_transfers()
        step = LinearStep(
            self.dev, TorchDeltaRule(), torch.zeros(0, dtype=torch.int64),
            copies=torch.from_numpy(cache.take_copies()),
            inits=torch.from_numpy(inits) if inits is not None else None, stores=stores, loads=loads,
        )  # fmt: skip
        run_copies(step, self.host)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_an_evicted_snapshot_goes_to_the_host_and_a_hit_resumes_from_what_the_device_held():
    kv = _kv(snapshots=1, host_snapshots=2)
    cache, pools = hybrid_cache(kv), _Pools(kv)
    a, b = np.arange(100, 116, dtype=np.int32), np.arange(200, 216, dtype=np.int32)
    put(cache, a)
    node_a = _snap(cache, a)
    slot = node_a.snapshot
    held_a = pools.state(slot)
    put(cache, b)
    node_b = _snap(cache, b)  # the only device slot: a's snapshot goes to the host
    assert node_b.snapshot == slot and node_a.snapshot < 0 and node_a.host_snapshot >= 0
    assert node_a.snaps_below == 1 and cache.stored_snapshots == 1
    kv.check(())
    m = cache.match_prefix(_ids(a, [7]))
    assert m.length == 16 and m.node is node_a and m.host_node is None  # resumable from the host
    pools.run(kv)  # the store: a's state to its host slot, before b's cut would write the slot
    assert _same(pools.host_state(node_a.host_snapshot), held_a)
    for t in (*pools.dev.conv, *pools.dev.delta):
        t[slot] = 42.0  # b's state, as its cut wrote it

    req = make_req("r", _ids(a, [7]).tolist())
    kv.admit(req, kv.match(req))  # a's snapshot back to the device slot; b's goes to the host
    assert req.cached_len == 16 and req.last_node is node_a and req.state_src == node_a.snapshot == slot
    assert node_b.snapshot < 0 and node_b.host_snapshot >= 0 and cache.loaded_snapshots == 1
    kv.check([req])
    assert req.req_pool_idx is not None
    pools.run(kv, np.array([req.state_src, req.req_pool_idx]))  # stores, loads, then the request's init
    assert _same(pools.state(req.req_pool_idx), held_a)  # the request starts from what the device held
    assert all(bool((t == 42.0).all()) for t in pools.host_state(node_b.host_snapshot))  # b's, stored first
    kv.release(req)
    kv.check(())
    cache.evict(kv.capacity)
    cache.evict_host(cache.host_size)
    assert not cache.held and not cache.host_held and cache.snapshots.num_free == 1
    assert cache.host_snapshots is not None and cache.host_snapshots.num_free == 2
    kv.check(())


def test_a_store_reads_the_row_whose_copy_into_the_evicted_slot_has_not_run():
    kv = _kv(snapshots=1, host_snapshots=1)
    cache, pools = hybrid_cache(kv), _Pools(kv)
    a, b = np.arange(100, 116, dtype=np.int32), np.arange(200, 216, dtype=np.int32)
    put(cache, a)
    row = 2
    node_a = _snap(cache, a)  # as a request's end takes one (cache_finished_req): a copy of its row ...
    cache.copies[node_a.snapshot] = row  # ... into the slot, queued for the next step
    row_state = pools.state(row)
    put(cache, b)
    _snap(cache, b)  # takes a's slot before the copy ran: the store reads the row, the copy goes
    assert not cache.copies and node_a.host_snapshot >= 0
    kv.check(())
    pools.run(kv)
    assert _same(pools.host_state(node_a.host_snapshot), row_state)


def test_a_store_into_a_host_slot_dropped_before_the_step_goes():
    kv = _kv(snapshots=1, host_snapshots=1)
    cache = hybrid_cache(kv)
    a, b, c = (np.arange(s, s + 16, dtype=np.int32) for s in (100, 200, 300))
    put(cache, a)
    _snap(cache, a)
    put(cache, b)
    node_b = _snap(cache, b)  # a's to the host slot: a store queued into it
    (host_slot,) = cache.snap_stores
    b_slot = node_b.snapshot
    put(cache, c)
    _snap(cache, c)  # b's to the host: the one host slot is a's, which goes, its store with it
    assert node_b.host_snapshot == host_slot and cache.snap_stores == {host_slot: b_slot}
    assert cache.match_prefix(_ids(a, [1])).length == 0  # a is not resumable any more
    kv.check(())
    stores, _ = cache.take_state_transfers()
    assert len(stores) == 2 and stores[1] == host_slot  # one store into the slot, not two
    cache.evict(kv.capacity)  # nodes leaving the tree drop their host snapshots too
    cache.evict_host(cache.host_size)
    assert not cache.host_held and cache.host_snapshots is not None and cache.host_snapshots.num_free == 1
    kv.check(())


def test_a_load_with_every_device_snapshot_locked_is_not_resumed_there():
    kv = _kv(snapshots=1, host_snapshots=2)
    cache = hybrid_cache(kv)
    a, b = np.arange(100, 116, dtype=np.int32), np.arange(200, 216, dtype=np.int32)
    put(cache, a)
    node_a = _snap(cache, a)
    put(cache, b)
    _snap(cache, b)  # a's snapshot to the host
    holder = make_req("h", _ids(b, [1]).tolist())
    kv.admit(holder, kv.match(holder))  # locks b's, the only device snapshot
    req = make_req("r", _ids(a, [7]).tolist())
    m = kv.match(req)
    assert m.length == 16 and node_a.snapshot < 0
    kv.admit(req, m)  # no device slot for a's snapshot: it does not resume at a (the adder unadmits)
    assert req.cached_len == 0 and req.cached_len < m.length and not cache.snap_loads
    kv.check([holder, req])
    kv.unadmit(req)
    kv.release(holder)
    kv.check(())
    req2 = make_req("r2", _ids(a, [7]).tolist())
    kv.admit(req2, kv.match(req2))  # unlocked now: it loads
    assert req2.cached_len == 16 and len(cache.snap_loads) == 1
    kv.release(req2)
    kv.check(())


def test_a_request_at_a_host_snapshot_waits_for_a_device_slot_and_the_others_go_on():
    """The one device snapshot slot is locked by a long request: one whose prefix resumes at a
    host-only snapshot waits (its admission could only be undone), a request behind it is admitted,
    and the first resumes from the host once the slot is free."""
    s = sched(total=512, page=4, host=2048, snapshots=1, host_snapshots=4, min_new_token_ratio=0.0)
    runner = runner_for(s)
    a, b = [1000 + i for i in range(PREFIX)], [2000 + i for i in range(PREFIX)]
    for rid, ids in (("a", a), ("b", b)):  # each ends with a snapshot at its prompt: a's to the host
        s.add(make_req(rid, ids, max_new=2))
        run_to_completion(s)
    assert runner.snapshots_stored >= 1
    s.add(make_req("long", [*b, 5, 6], max_new=40, t=1.0))  # resumes at b's: locks the only slot
    step(s, runner)
    s.add(make_req("a2", [*a, 7, 8], max_new=4, t=2.0))  # a's snapshot is on the host only
    s.add(make_req("fresh", [3000 + i for i in range(8)], max_new=4, t=3.0))
    step(s, runner)
    live = {r.rid for r in s.running}
    assert "fresh" in live and "a2" not in live, live
    done = {r.rid: r for r in run_to_completion(s)}
    assert done["a2"].num_cached_tokens >= PREFIX - 4  # resumed from the host snapshot, not from zero
    assert done["a2"].output_ids == reference_output(done["a2"].origin_ids.tolist(), 4)
    _all_free(s)


def test_a_host_snapshot_a_queued_load_reads_is_never_reused_in_that_step():
    kv = _kv(snapshots=2, host_snapshots=1)
    cache = hybrid_cache(kv)
    a, b, c = (np.arange(s, s + 16, dtype=np.int32) for s in (100, 200, 300))
    put(cache, a)
    node_a = _snap(cache, a)
    put(cache, b)
    _snap(cache, b)
    put(cache, c)
    _snap(cache, c)  # a's (the least recent) to the one host slot
    cache.take_state_transfers()  # (that step ran)
    assert node_a.host_snapshot >= 0 and node_a.snapshot < 0
    req = make_req("r", _ids(a, [7]).tolist())
    kv.admit(req, kv.match(req))  # a's loaded back; b's goes to the device's LRU but finds no host slot
    assert len(cache.snap_loads) == 1 and node_a.snapshot >= 0
    kv.unadmit(req)  # a unlocked, its load still queued
    put(cache, np.arange(400, 416, dtype=np.int32))
    slot = cache.alloc_snapshot()  # evicts c's or a's device snapshot: never a's host slot
    assert slot is not None
    assert node_a.host_snapshot >= 0 and cache.host_held[node_a.host_snapshot] is node_a
    if node_a.snapshot >= 0:
        assert cache.snap_loads == {node_a.snapshot: node_a.host_snapshot}
    else:  # a's device slot went: the load into it with it
        assert not cache.snap_loads
    cache.snapshots.free(slot)
    kv.check(())


def test_the_runner_runs_stores_then_loads_then_copies_then_inits():
    kv = _kv(snapshots=2, host_snapshots=2)
    pools = _Pools(kv)
    snap0, snap1 = ROWS + 2, ROWS + 3  # (the first snapshot slots)
    before = {s: pools.state(s) for s in (0, 1, snap0, snap1)}
    pools.host.store(pools.dev, np.array([snap1, 1], dtype=np.int64))  # host slot 1 holds snap1's state
    step = LinearStep(
        pools.dev, TorchDeltaRule(), torch.zeros(0, dtype=torch.int64),
        stores=np.array([snap0, 0], dtype=np.int64),  # snap0 -> host 0, read before ...
        loads=np.array([1, snap0], dtype=np.int64),  # ... host 1 -> snap0 writes it
        copies=torch.tensor([0, snap1]),  # row 0 -> snap1 (a slot the load did not touch) ...
        inits=torch.tensor([snap0, 0]),  # ... read before the init writes row 0 from snap0
    )  # fmt: skip
    run_copies(step, pools.host)
    assert _same(pools.host_state(0), before[snap0])
    assert _same(pools.state(snap0), before[snap1])
    assert _same(pools.state(snap1), before[0])
    assert _same(pools.state(0), before[snap1])


def test_host_snapshot_sizing_from_the_host_budget_and_its_refusal():
    per_slot = SHAPE.nbytes(torch.float32)
    n, nbytes = plan_host_states(SHAPE, torch.float32, 100 * per_slot)
    assert n == 50 and nbytes == 50 * per_slot  # half the host memory by default
    assert plan_host_states(SHAPE, torch.float32, 100 * per_slot, 3) == (3, 3 * per_slot)
    with pytest.raises(ValueError, match=r"^host_state_snapshots: 100 snapshots take"):
        plan_host_states(SHAPE, torch.float32, 100 * per_slot, 100)


# --------------------------------------------------- the scheduler, with the echo runner
def _conversations(host_snapshots: int, snapshots: int, convs: int, turns: int, chunk: int | None):
    s = sched(
        total=160, page=4, host=2048, snapshots=snapshots, host_snapshots=host_snapshots,
        chunked_prefill_size=chunk, min_new_token_ratio=0.0,
    )  # fmt: skip
    prefixes = [[1000 + 100 * c + i for i in range(PREFIX)] for c in range(convs)]
    history = [list(p) for p in prefixes]
    for turn in range(turns):
        for c in range(convs):
            history[c] += [7 + turn, 9 + c]
            s.add(make_req(f"c{c}t{turn}", history[c], max_new=6, t=float(10 * turn + c)))
        done = {r.rid: r for r in run_to_completion(s)}  # the invariants, every KV and state, every step
        for c in range(convs):
            r = done[f"c{c}t{turn}"]
            assert r.output_ids == reference_output(r.origin_ids.tolist(), 6), r.rid
            history[c] += r.output_ids
    return s


def _all_free(s) -> None:
    kv, cache = s.kv, hybrid_cache(s.kv)
    kv.check(())
    cache.evict(kv.capacity)
    cache.evict_host(cache.host_size)
    assert kv.allocator.free_tokens == kv.capacity and cache.host_size == 0
    assert cache.snapshots.num_free == cache.snapshots.capacity and not cache.copies
    assert cache.host_snapshots is None or cache.host_snapshots.num_free == cache.host_snapshots.capacity
    assert not cache.host_held and not cache.snap_stores and not cache.snap_loads


def test_scheduler_serves_more_prompt_tokens_from_the_host_with_host_snapshots():
    """Six conversations, three turns, four device snapshot slots: without host snapshots the others
    take every one between two turns of a conversation; with them, its prefix resumes."""
    without = _conversations(0, snapshots=4, convs=6, turns=3, chunk=8)
    with_host = _conversations(64, snapshots=4, convs=6, turns=3, chunk=8)
    assert runner_for(with_host).snapshots_stored > 0 and runner_for(with_host).snapshots_loaded > 0
    assert with_host.kv.hit_tokens["host"] >= without.kv.hit_tokens["host"] + 2 * PREFIX
    assert with_host.prefill_tokens <= without.prefill_tokens - 3 * PREFIX
    _all_free(with_host)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 4), st.integers(1, 8), st.integers(2, 5), st.integers(1, 3), st.sampled_from([None, 8]))
def test_random_conversations_resume_from_snapshots_on_either_tier(
    snapshots, host_snapshots, convs, turns, chunk
):
    """Random pool sizes, conversations and chunking: every step the echo runner checks each request's
    state and each snapshot on either tier against its node's tokens, and the manager every pool's
    ownership (host snapshot slots included); the outputs are the reference's; every pool is free
    after."""
    _all_free(_conversations(host_snapshots, snapshots, convs, turns, chunk))


# ------------------------------------------------------------------- the engine, tiny Qwen3.5
@pytest.fixture(scope="module")
def qwen_dir(demo_model):
    return demo_model("qwen3_5")


def test_engine_greedy_tokens_equal_tiers_off_and_host_snapshots_serve_more(qwen_dir):
    """Four device snapshot slots for six conversations (six running requests, each locking the ones
    it started from): the host snapshots make more of their second turns' prefixes resumable from
    the host (measured: 164 prompt tokens from the host instead of 0, 461 computed instead of 640)."""
    off, _ = engine_turns(qwen_dir, host_kv_cache_gb=0.0, max_state_snapshots=4)
    no_snaps, s_no = engine_turns(
        qwen_dir, host_kv_cache_gb=0.01, max_state_snapshots=4, host_state_snapshots=0
    )
    on, s_on = engine_turns(qwen_dir, host_kv_cache_gb=0.01, max_state_snapshots=4)
    tokens = [[o["token_ids"] for o in t] for t in off]
    assert [[o["token_ids"] for o in t] for t in on] == tokens
    assert [[o["token_ids"] for o in t] for t in no_snaps] == tokens
    cache = hybrid_cache(s_on.kv)
    assert cache.host_snapshots is not None and cache.stored_snapshots > 0 and cache.loaded_snapshots > 0
    assert s_on.kv.hit_tokens["host"] >= s_no.kv.hit_tokens["host"] + 2 * PREFIX
    assert s_on.prefill_tokens <= s_no.prefill_tokens - 2 * PREFIX
    assert hybrid_cache(s_no.kv).host_snapshots is None
    assert s_on.kv.req_to_token.num_free == s_on.kv.req_to_token.max_running
    _all_free(s_on)
