"""The host KV tier (docs/architecture.md, "KV tiers"): prefixes evicted from a small device pool are
written back to host pages and loaded back when a request hits them, with the same outputs, fewer
prefill tokens, the accounting invariant over both tiers after every step, and every page back
after the load.

The scheduler tests run the model-free echo runner (tests/helpers/scheduler.py), whose fake KV pool
and fake host pool run the copies the scheduler plans: a load that brings back the wrong page, or a
page freed while a copy still reads it, makes some request's KV read back wrong and fails there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.host_pool import HostKVPool
from radixserve.scheduler.memory.hybrid_tiered_cache import HybridTieredCache
from radixserve.scheduler.memory.manager import KVCacheManager, MemoryConfig
from radixserve.scheduler.memory.tiered_cache import KVTransfers
from tests.helpers.host_tier import PREFIX, SCHEDULER_CASES, engine_turns, random_kv_pool
from tests.helpers.radix import put
from tests.helpers.scheduler import make_req, reference_output, run_to_completion, runner_for, sched


def _manager(device: int, host: int) -> KVCacheManager:
    return KVCacheManager(MemoryConfig(max_total_tokens=device, page_size=4, host_kv_tokens=host))


def _conversations(n: int) -> list[list[int]]:
    return [[1000 + 100 * c + i for i in range(PREFIX)] for c in range(n)]


def _two_rounds(host: int, **kw):
    """Six conversations, two turns each, through a device pool that holds about two of them."""
    s = sched(total=160, page=4, host=host, min_new_token_ratio=0.0, **kw)
    convs = _conversations(6)
    outputs = {}
    for turn in range(2):
        for c, prefix in enumerate(convs):
            s.add(make_req(f"c{c}t{turn}", [*prefix, 7 + turn, 9 + c], max_new=12, t=float(10 * turn + c)))
        for r in run_to_completion(s):  # checks the invariant and every request's KV at every step
            outputs[r.rid] = r.output_ids
            assert r.output_ids == reference_output(r.origin_ids.tolist(), 12), r.rid
    return s, outputs


@SCHEDULER_CASES
def test_host_tier_serves_evicted_prefixes_with_the_same_outputs_and_fewer_prefill_tokens(kw):
    off, out_off = _two_rounds(0, **{k: v for k, v in kw.items() if k != "write_through"})
    on, out_on = _two_rounds(2048, **kw)
    assert out_on == out_off
    echo = runner_for(on)
    assert echo.stored > 0 and echo.loaded > 0
    # the second turns' prefixes come back from the host instead of being computed again
    assert on.prefill_tokens <= off.prefill_tokens - 3 * PREFIX
    if kw["init_new_token_ratio"] == 0.0:
        assert on.num_retractions > 0
    # after the load: nothing locked on either tier, and both pools give every page back
    kv = on.kv
    kv.check(())
    assert kv.available() == kv.capacity and kv.cache.protected_size == 0
    kv.cache.evict(kv.capacity)
    assert kv.host is not None
    kv.check(())
    kv.cache.evict_host(kv.host.capacity_tokens)
    assert kv.allocator.free_tokens == kv.capacity and kv.host.free_tokens == kv.host.capacity_tokens


def test_host_tier_stays_within_its_size_and_evicts_least_recently_used_first():
    kv = _manager(device=64, host=64)
    cache = kv.cache
    seqs = [np.arange(100 * i, 100 * i + 32, dtype=np.int32) for i in range(6)]
    for seq in seqs:  # each insert evicts the one before from the 64-token device pool
        short = 8 - kv.allocator.num_free_pages
        if short > 0:
            cache.evict(short * 4)
        cache.insert(seq, kv.allocator.pages_to_slots(kv.allocator.alloc_pages(8)))
        kv.check(())
        assert kv.host is not None and cache.host_size <= kv.host.capacity_tokens
    # the device holds the last two; the host the two before them, not the oldest
    held = [cache.match_prefix(s) for s in seqs]
    assert [len(m.slots) for m in held] == [0, 0, 0, 0, 32, 32]
    assert [m.host_len for m in held] == [0, 0, 32, 32, 0, 0]


def test_a_load_back_takes_device_pages_and_queues_the_copies_from_the_host_pages():
    kv = _manager(device=32, host=64)
    cache = kv.cache
    a = np.arange(1, 33, dtype=np.int32)
    cache.insert(a, kv.allocator.pages_to_slots(kv.allocator.alloc_pages(8)))
    old = cache.match_prefix(a).slots.copy()
    cache.evict(32)
    wrote = cache.take_transfers()
    assert wrote is not None and np.array_equal(wrote.store_src, old) and len(wrote.load_src) == 0
    m = cache.match_prefix(a[:20])  # page aligned: 20 tokens
    assert len(m.slots) == 0 and m.host_len == 20
    cache.lock(m.node)
    loaded = cache.load_back(m)
    cache.lock(loaded.node)
    cache.unlock(m.node)
    assert len(loaded.slots) == 20
    t = cache.take_transfers()
    assert t is not None and np.array_equal(t.load_src, wrote.store_dst[:20])
    assert np.array_equal(t.load_dst, loaded.slots) and len(t.store_src) == 0
    cache.unlock(loaded.node)
    kv.check(())


def test_host_eviction_frees_a_node_once_when_its_host_only_child_goes_first():
    # (found by TieredCacheMachine: the parent was queued twice and its host copy counted off twice)
    kv = _manager(device=32, host=32)
    cache = kv.cache
    a = np.arange(1, 25, dtype=np.int32)
    cache.insert(a, kv.allocator.pages_to_slots(kv.allocator.alloc_pages(6)))
    cache.evict(24)  # to the host
    m = cache.match_prefix(a[:16])  # splits the host node: 16 + 8
    cache.lock(m.node)
    loaded = cache.load_back(m)
    cache.unlock(m.node)
    cache.take_transfers()
    assert cache.evict_host(100) == 24  # the 8 host-only tokens, then the loaded part's host copy
    assert cache.host_size == 0 and loaded.node.on_device
    kv.check(())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_device_to_host_to_device_byte_exact(dtype):
    page, layers, heads, dim = 4, 3, 2, 8
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = random_kv_pool(17 * page, layers, heads, dim, dtype, device)
    before = [t.clone() for t in (*pool.k, *pool.v)]
    host = HostKVPool(9 * page, layers, heads, dim, dtype, torch.device(device))
    src = PagedAllocator(16, page).pages_to_slots(np.array([3, 7, 8, 15], dtype=np.int64))
    dst_host = PagedAllocator(8, page).pages_to_slots(np.array([6, 1, 2, 5], dtype=np.int64))
    empty = np.zeros(0, dtype=np.int64)
    host.run(pool, KVTransfers(src, dst_host, empty, empty))
    for t in (*pool.k, *pool.v):  # the device pages are overwritten after the write-back
        t.index_fill_(0, torch.as_tensor(src, device=device), 0)
    back = PagedAllocator(16, page).pages_to_slots(np.array([1, 2, 10, 11], dtype=np.int64))
    host.run(pool, KVTransfers(empty, empty, dst_host, back))
    host.synchronize()
    for got, want in zip((*pool.k, *pool.v), before, strict=True):
        assert torch.equal(got[torch.as_tensor(back, device=device)].cpu().view(torch.uint8),
                           want[torch.as_tensor(src, device=device)].cpu().view(torch.uint8))  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(demo_model):
    return demo_model("llama")


def test_engine_greedy_tokens_are_the_same_with_the_host_tier_on_and_off(llama_dir):
    off, s_off = engine_turns(llama_dir, host_kv_cache_gb=0.0, disable_overlap=True)
    on, s_on = engine_turns(llama_dir, host_kv_cache_gb=0.01, disable_overlap=False)
    assert [[o["token_ids"] for o in t] for t in on] == [[o["token_ids"] for o in t] for t in off]
    hits_on = sum(o["meta_info"]["cached_tokens"] for o in on[1])
    hits_off = sum(o["meta_info"]["cached_tokens"] for o in off[1])
    assert hits_on >= hits_off + 3 * PREFIX  # the second turns' prefixes came back from the host
    assert s_on.prefill_tokens < s_off.prefill_tokens and s_on.num_retractions > 0
    assert s_on.kv.cache.loaded_tokens >= 3 * PREFIX and s_on.kv.cache.written_back_tokens > 0


def test_settings_the_host_tier_cannot_serve_are_refused_by_name(llama_dir):
    from radixserve import Engine

    with pytest.raises(ValueError, match="host_kv_cache_gb 1e-09 holds no KV page"):
        Engine(llama_dir, max_total_tokens=160, host_kv_cache_gb=1e-9, warmup=False)
    # a hybrid model gets the host tier (tests/unit/test_hybrid_host_tier.py), not the disk tier
    config = MemoryConfig(max_total_tokens=64, hybrid=True, state_snapshots=2, host_kv_tokens=64)
    hybrid = KVCacheManager(config)
    assert isinstance(hybrid.cache, HybridTieredCache)


STEMS = [list(range(1, 33)), list(range(40, 56)), [3, 1, 4, 1, 5, 9, 2, 6] * 3]


class TieredCacheMachine(RuleBasedStateMachine):
    """Random steps on a small device pool and a smaller host pool: evictions (with write-back),
    host evictions, matches loaded back, then a step (the queued copies run, then the step's forward
    writes its new tokens' KV, and the tree takes them). After every step the invariant holds on both
    tiers and every node's KV reads back as its tokens on each tier that holds it."""

    @initialize(
        page=st.sampled_from([1, 2, 4]),
        pages=st.integers(10, 24),
        host_pages=st.integers(1, 16),
        write_through=st.booleans(),
    )
    def setup(self, page, pages, host_pages, write_through):
        self.kv = KVCacheManager(MemoryConfig(max_total_tokens=pages * page, page_size=page,
                                              host_kv_tokens=host_pages * page,
                                              kv_write_through=write_through))  # fmt: skip
        assert self.kv.host is not None
        self.page = page
        self.dev = np.full(self.kv.allocator.pool_slots, -1, dtype=np.int64)
        self.host = np.full(self.kv.host.pool_slots, -1, dtype=np.int64)
        self.locked: list = []

    OP = st.tuples(
        st.sampled_from(["evict", "evict_host", "load", "load_unadmitted"]),
        st.integers(0, 40),
        st.sampled_from(STEMS),
        st.lists(st.integers(60, 70), max_size=12),
    )

    @rule(
        ops=st.lists(OP, max_size=4),
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(60, 70), max_size=16),
    )
    def step(self, ops, stem, tail):
        cache = self.kv.cache
        for op, n, s, t in ops:
            if op == "evict":
                cache.evict(n)
            elif op == "evict_host":
                cache.evict_host(n)
            elif op == "load":
                self.locked.append(self._load(np.array(s + t, dtype=np.int32)))
            else:  # loaded for a request that did not fit after all: its pages may go this step
                cache.unlock(self._load(np.array(s + t, dtype=np.int32)))
        seq = np.array(stem + tail, dtype=np.int32)
        seq = seq[: len(seq) - len(seq) % self.page]
        node = self._load(seq)  # the step's request: its prefix (loaded back), then new pages
        self.kv.check(())  # with copies queued: each into pages of the node it was queued for
        have = cache.match_prefix(seq).slots
        need = (len(seq) - len(have)) // self.page
        new = np.zeros(0, dtype=np.int64)
        if need:
            short = need - self.kv.allocator.num_free_pages
            if short > 0:
                cache.evict(short * self.page)
            if self.kv.allocator.num_free_pages >= need:
                new = self.kv.allocator.pages_to_slots(self.kv.allocator.alloc_pages(need))
        self._copies()  # the step: copies first, write-backs before loads ...
        if len(new):  # ... then the forward writes the new tokens' KV, and the tree takes it
            self.dev[new] = seq[len(have) :]
            res = cache.insert(seq, np.concatenate([have, new]))
            self.kv.allocator.free_slots(np.concatenate([have, new])[len(have) : res.present_len])
        for locked in [*self.locked, node]:
            cache.unlock(locked)
        self.locked = []

    def _copies(self):
        t = self.kv.cache.take_transfers()
        if t is not None:
            self.host[t.store_dst] = self.dev[t.store_src]
            self.dev[t.load_dst] = self.host[t.load_src]

    def _load(self, seq):
        cache = self.kv.cache
        m = cache.match_prefix(seq)
        cache.lock(m.node)
        loaded = cache.load_back(m)
        cache.lock(loaded.node)
        cache.unlock(m.node)
        return loaded.node

    @invariant()
    def tiers_hold_their_tokens(self):
        if not hasattr(self, "kv") or self.locked:
            return
        self.kv.check(())
        host = self.kv.host
        assert host is not None and self.kv.cache.host_size <= host.capacity_tokens
        self._copies()  # write-throughs queued at insert: the next step runs them before any reader
        for node in self.kv.cache.nodes():
            if node.on_device:
                assert np.array_equal(self.dev[node.value], node.key), "device KV is not its tokens"
            if node.on_host:
                assert np.array_equal(self.host[node.host_value], node.key), "host KV is not its tokens"

    def teardown(self):
        if hasattr(self, "kv"):
            self.kv.cache.evict(self.kv.capacity)
            self.kv.cache.evict_host(self.kv.capacity * 4)
            assert self.kv.allocator.free_tokens == self.kv.capacity
            assert self.kv.host is not None and self.kv.host.free_tokens == self.kv.host.capacity_tokens


TestTieredCache = TieredCacheMachine.TestCase
TestTieredCache.settings = settings(
    max_examples=80, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_hit_counts_only_grow_an_admission_undone_is_never_counted():
    """``hit_tokens`` feeds a Prometheus counter read from another thread: an admission the prefill
    adder undoes (no pages after all) must not show in it for a moment and then go."""
    kv = _manager(64, 64)
    prefix = np.arange(100, 116, dtype=np.int32)
    put(kv.cache, prefix)
    req = make_req("r", [*prefix.tolist(), 7])
    kv.admit(req, kv.match(req))
    assert req.cached_len == 16 and kv.hit_tokens["device"] == 0  # not counted until it stands
    kv.unadmit(req)
    kv.settle_hits()
    assert kv.hit_tokens["device"] == 0
    kv.admit(req, kv.match(req))
    kv.settle_hits()  # the step is scheduled: it stands
    assert kv.hit_tokens["device"] == 16
