"""Property tests: the memory invariants hold after every operation, whatever the sequence.

free + evictable + protected + held-by-running == capacity; no page has two owners or
none; a locked node is never evicted; every request's KV reads back as its tokens. For a hybrid
model's scheduler also: every state snapshot slot has one owner, and every request's recurrent
state and every snapshot the tree holds is exactly its prefix's (tests/helpers/scheduler.py).
"""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.memory.radix_cache import RadixCache
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.req import Req
from tests.helpers.scheduler import reference_output, run_to_completion, runner_for

PREFIXES = [list(range(1, 41)), list(range(50, 70)), [3, 1, 4, 1, 5, 9, 2, 6] * 4]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2, 4, 8]),
        pages=st.integers(24, 80),
        policy=st.sampled_from(["lpm", "fcfs", "dfs-weight"]),
        chunk=st.sampled_from([None, 8, 16, 32]),
        no_cache=st.booleans(),
        fairness=st.sampled_from([None, 0.0, 3.0]),
        ratio=st.sampled_from([0.0, 0.3, 0.7]),
        overlap=st.booleans(),
        snapshots=st.sampled_from([None, 0, 2, 8]),
        host_pages=st.sampled_from([0, 0, 8, 40]),
    )
    def setup(self, page, pages, policy, chunk, no_cache, fairness, ratio, overlap, snapshots, host_pages):
        """``snapshots``: a hybrid model's scheduler (recurrent states, that many prefix snapshots);
        ``host_pages``: a host KV tier of that many pages."""
        chunk = None if chunk is None else max(chunk, page)
        mem = MemoryConfig(
            max_total_tokens=pages * page,
            page_size=page,
            max_running_requests=6,
            max_context_len=256,
            disable_radix_cache=no_cache,
            hybrid=snapshots is not None,
            state_snapshots=snapshots or 0,
            snapshot_interval=16,
            host_kv_tokens=host_pages * page,
        )
        self.t = 0.0
        cfg = SchedulerConfig(
            memory=mem,
            policy=policy,
            chunked_prefill_size=chunk,
            max_prefill_tokens=48,
            fairness_timeout=fairness,
            init_new_token_ratio=ratio,
            min_new_token_ratio=0.0,
            max_consecutive_prefills=2,
            dedup_min_tokens=8,
        )
        self.s = BatchScheduler(cfg, clock=lambda: self.t)
        self.runner = runner_for(self.s)
        # overlap: schedule (and run) batch N+1 before processing batch N, as the overlap loop does
        self.overlap = overlap
        self.pending: list = []
        self.n = 0
        self.expected: dict[str, list[int]] = {}
        self.done: dict[str, Req] = {}

    @rule(
        prefix=st.sampled_from([*PREFIXES, []]),
        tail=st.lists(st.integers(0, 90), max_size=20),
        max_new=st.integers(1, 16),
    )
    def add(self, prefix, tail, max_new):
        prompt = (prefix + tail) or [7]
        if len(prompt) + max_new > self.s.kv.capacity:
            return
        rid = f"r{self.n}"
        self.n += 1
        self.s.add(Req(rid, prompt, SamplingParams(max_new_tokens=max_new), arrival_time=self.t))
        self.expected[rid] = reference_output(prompt, max_new)

    @rule(k=st.integers(1, 4))
    def steps(self, k):
        for _ in range(k):
            self.t += 1.0
            batch = self.s.schedule()
            if batch is not None:
                self.s.kv.check(self.s.live_requests())
                self.pending.append((batch, self.runner.forward(batch)))
            if batch is None and not self.pending:
                assert self.s.idle  # nothing scheduled and nothing in flight: no work may be left
                return
            keep = 1 if self.overlap and batch is not None else 0
            while len(self.pending) > keep:
                done_batch, tokens = self.pending.pop(0)
                for r in self.s.process(done_batch, tokens):
                    self.done[r.rid] = r

    @precondition(lambda self: self.n > 0)
    @rule(i=st.integers(0, 1000))
    def abort(self, i):
        rid = f"r{i % self.n}"
        r = self.s.abort(rid)
        if r is not None:
            self.expected.pop(rid)

    @invariant()
    def accounting_holds(self):
        if hasattr(self, "s"):
            self.s.kv.check(self.s.live_requests())

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for batch, tokens in self.pending:
            for r in self.s.process(batch, tokens):
                self.done[r.rid] = r
        for r in run_to_completion(self.s):
            self.done[r.rid] = r
        for rid, out in self.expected.items():
            assert self.done[rid].output_ids == out, rid
        assert self.s.kv.available() == self.s.kv.capacity
        self.s.kv.cache.evict(self.s.kv.capacity)
        assert self.s.kv.allocator.free_tokens == self.s.kv.capacity
        host = self.s.kv.host
        if host is not None:  # the host tier holds at most its size, and gives it all back
            self.s.kv.check(())
            self.s.kv.cache.evict_host(host.capacity_tokens)
            assert host.free_tokens == host.capacity_tokens and self.s.kv.cache.host_size == 0
        hybrid = self.s.kv.states.hybrid if self.s.kv.states is not None else None
        if hybrid is not None:  # every snapshot slot free again (the rows' states: the rows, checked above)
            assert hybrid.snapshots.num_free == hybrid.snapshots.capacity and not hybrid.copies


TestScheduler = SchedulerMachine.TestCase


def test_a_load_queued_by_an_undone_admission_in_a_step_that_ran_nothing_still_runs():
    """An example this machine found (the suite, 2026-11-27): a request retracted with part of its
    KV written back to the host is re-admitted while two others finish (overlap: their last tokens
    in flight), its host part's load queued, the admission undone for want of room, and the step
    runs nothing; the next steps saw its prefix "loading" and waited for a load that no batch would
    ever carry. Now the second pass admits it and its step runs the load."""
    m = SchedulerMachine()
    m.setup(
        page=1, pages=44, policy="lpm", chunk=8, no_cache=False, fairness=None, ratio=0.0,
        overlap=True, snapshots=None, host_pages=8,
    )  # fmt: skip
    m.add(max_new=7, prefix=[], tail=[0, 0, 0])
    m.add(max_new=7, prefix=[], tail=[1, 0, 0, 0, 0])
    m.add(max_new=5, prefix=PREFIXES[1], tail=[0])
    for k in (1, 1, 1, 1, 3, 4):
        m.steps(k=k)
        m.accounting_holds()
    assert m.s.kv.hit_tokens["host"] > 0  # the retracted request's prefix came back from the host
    m.teardown()


TestScheduler.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


class CacheMachine(RuleBasedStateMachine):
    """The bare cache: inserts, locks, unlocks and evictions in any order."""

    nodes = Bundle("nodes")

    @initialize(page=st.sampled_from([1, 2, 4]))
    def setup(self, page):
        self.ps = page
        self.alloc = PagedAllocator(200, page)
        self.cache = RadixCache(self.alloc, ReqToTokenPool(1, 8))
        self.locks: list = []

    @rule(target=nodes, seq=st.lists(st.integers(0, 3), min_size=1, max_size=16))
    def insert(self, seq):
        seq = seq * self.ps  # page aligned
        need = len(seq) // self.ps
        if need > self.alloc.num_free_pages:
            self.cache.evict((need - self.alloc.num_free_pages) * self.ps)
        if need > self.alloc.num_free_pages:
            return self.cache.root
        slots = self.alloc.pages_to_slots(self.alloc.alloc_pages(need))
        res = self.cache.insert(np.array(seq, dtype=np.int32), slots)
        self.alloc.free_slots(slots[: res.present_len])
        return res.node

    @rule(node=nodes)
    def lock(self, node):
        if node is self.cache.root or self._attached(node):
            self.cache.lock(node)
            self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        self.cache.unlock(self.locks.pop(i % len(self.locks)))

    @rule(n=st.integers(1, 60))
    def evict(self, n):
        before = self.cache.evictable_size
        freed = self.cache.evict(n)
        assert freed >= min(n, before) or self.cache.evictable_size == 0
        for node in self.locks:
            assert node is self.cache.root or self._attached(node), "a locked node was evicted"

    @rule(seq=st.lists(st.integers(0, 3), max_size=16))
    def match(self, seq):
        m = self.cache.match_prefix(np.array(seq * self.ps, dtype=np.int32))
        assert len(m.slots) % self.ps == 0

    def _attached(self, node):
        while node.parent is not None:
            if node.parent.children.get(node.key[: self.ps].tobytes()) is not node:
                return False
            node = node.parent
        return node is self.cache.root

    @invariant()
    def sizes_and_owners(self):
        if not hasattr(self, "cache"):
            return
        nodes = self.cache.nodes()
        assert sum(len(n) for n in nodes if n.lock_ref == 0) == self.cache.evictable_size
        assert sum(len(n) for n in nodes if n.lock_ref > 0) == self.cache.protected_size
        owned = [n.value[:: self.ps] // self.ps for n in nodes] + [self.alloc._stack[: self.alloc._top]]
        pages = np.concatenate(owned) if owned else np.zeros(0)
        assert sorted(pages.tolist()) == list(range(1, 201)), "a page is lost or owned twice"
        for n in nodes:
            if n.lock_ref and n.parent is not self.cache.root:
                assert n.parent.lock_ref >= n.lock_ref


TestCache = CacheMachine.TestCase
TestCache.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)
