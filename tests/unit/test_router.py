"""The gateway's routing policies: cache-aware (prefix index + recent routes + balance guard, and
least-load while the index is down), least-load and round-robin."""

from __future__ import annotations

import time

import pytest

from radixserve.common.prefix_index import InMemoryPrefixIndex, RedisPrefixIndex
from radixserve.common.rpc import pb
from radixserve.tokenizer.routing.router import (
    CacheAwareRouter,
    LeastLoadRouter,
    RecentRoutes,
    RoundRobinRouter,
)
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle
from tests.helpers.routing import BS, MODEL, hashes_of, pod, set_load, tokens
from tests.redis_server import free_port


@pytest.fixture
def index() -> InMemoryPrefixIndex:
    return InMemoryPrefixIndex()


def test_busy_is_what_the_pod_reported_or_what_this_gateway_sent_if_more() -> None:
    assert pod("a").busy == 0
    assert pod("a", waiting=3, running=4).busy == 7
    assert pod("a", waiting=1, running=1, outstanding=5).busy == 5
    assert SchedulerHandle("x").busy == 0  # no report yet


def test_cache_aware_picks_the_pod_with_the_longest_match(index: InMemoryPrefixIndex) -> None:
    a, b, c = pod("a"), pod("b", running=3), pod("c")
    ids = tokens(1, 8)
    h = hashes_of(ids)
    index.apply("a", h[:2], [])
    index.apply("b", h[:6], [])  # the longest, though busier
    router = CacheAwareRouter(index, MODEL, BS)
    assert router.choose(ids, [a, b, c]) is b
    d = router.decisions[-1]
    assert (d.pod, d.reason, d.matched_blocks) == ("b", "prefix", 6)
    assert d.seconds < 0.1
    # a pod the index knows but that is not a candidate (down, draining) is not chosen
    assert router.choose(ids, [a, c]) is a
    assert (router.decisions[-1].reason, router.decisions[-1].matched_blocks) == ("prefix", 2)


def test_cache_aware_ties_go_to_the_least_loaded(index: InMemoryPrefixIndex) -> None:
    a, b, c = pod("a", waiting=5), pod("b", running=1), pod("c")
    ids = tokens(1, 4)
    index.apply("a", hashes_of(ids), [])
    index.apply("b", hashes_of(ids), [])
    router = CacheAwareRouter(index, MODEL, BS)
    assert router.choose(ids, [a, b, c]) is b  # c is idler, but holds nothing
    assert router.decisions[-1].reason == "prefix"
    set_load(a, 0)
    set_load(b, waiting=4)
    assert router.choose(ids, [a, b, c]) is a


def route(router: CacheAwareRouter, ids: list[int], pods: list[SchedulerHandle]) -> SchedulerHandle:
    """What the gateway does with a decision: the pod counts the request until its next report."""
    h = router.choose(ids, pods)
    h.sent += 1
    return h


def test_busy_counts_what_was_sent_since_the_last_report() -> None:
    a = pod("a", waiting=2, running=3)
    a.sent = 4
    assert a.busy == 9
    a.reported(pb.Load(waiting=1, running=8))  # the report includes them
    assert (a.busy, a.sent, a.routed_tokens) == (9, 0, 0)


def test_a_new_prefix_goes_to_the_least_busy_pod_then_the_smallest_working_set(
    index: InMemoryPrefixIndex,
) -> None:
    a = pod("a", waiting=41)
    b = pod("b", running=40)
    c = pod("c", waiting=57)
    router = CacheAwareRouter(index, MODEL, BS)
    assert route(router, tokens(1, 3), [a, b, c]) is b
    assert router.decisions[-1].reason == "no-match"
    assert b.routed_tokens == 53  # counted until b's next load report
    # 40 + 1 sent: as busy as a; a's working set is the smaller (none)
    assert route(router, tokens(2, 5), [a, b, c]) is a
    assert route(router, tokens(3, 3), [a, b, c]) is b  # a is busier now
    # equally busy pods: the smaller working set (a's warm cache, full or not, says nothing of use)
    a.reported(pb.Load(running=10, kv_cached_tokens=500))
    b.reported(pb.Load(running=10))
    assert [router.working_set.blocks(x, time.monotonic()) for x in "abc"] == [5, 6, 0]
    assert router.choose(tokens(4, 3), [a, b, c]) is a
    assert router.choose(list(range(5)), [a, b, c]).address in "ab"  # shorter than a block: no match
    assert router.decisions[-1].reason == "no-match"


def test_a_burst_of_unique_prompts_spreads_evenly(index: InMemoryPrefixIndex) -> None:
    """32 concurrent prompts that share nothing, some shorter than a block (no working set), before
    any pod reports: the load this gateway sent splits them."""
    pods = [pod("a"), pod("b")]
    router = CacheAwareRouter(index, MODEL, BS)
    got = [route(router, tokens(i, i % 3), pods).address for i in range(32)]
    assert (got.count("a"), got.count("b")) == (16, 16)
    four = [pod(x) for x in "wxyz"]
    got = [route(router, tokens(100 + i, 1 + i % 2), four).address for i in range(64)]
    assert sorted(got.count(x) for x in "wxyz") == [16, 16, 16, 16]


def test_a_new_prefix_goes_where_the_kv_has_room_for_it_before_it_goes_where_it_is_idle(
    index: InMemoryPrefixIndex,
) -> None:
    # The burst that piled six tenants onto one pod: b holds two popular tenants, so its queue is
    # long, while a and c are idler but their working sets already fill their KV.
    a, b, c = pod("a", waiting=2), pod("b", waiting=30), pod("c", waiting=4)
    for h in (a, b, c):
        h.load.kv_capacity_tokens = 20 * BS
    router = CacheAwareRouter(index, MODEL, BS, kv_fill=0.9)  # a new prefix fits within 18 blocks
    now = time.monotonic()
    router.working_set.remember(hashes_of(tokens(1, 14)), "a", now)
    router.working_set.remember(hashes_of(tokens(2, 4)), "b", now)
    router.working_set.remember(hashes_of(tokens(3, 12)), "c", now)
    # 4 blocks (+ a partial one) fit on c (12 + 5 <= 18) and on b; c is less busy: c
    assert router.choose(tokens(4, 4), [a, b, c]) is c
    assert router.decisions[-1].reason == "no-match"
    # now c holds 16 blocks: the next 4-block prefix fits only on b, the busy one
    assert router.choose(tokens(5, 4), [a, b, c]) is b
    # where it fits nowhere, the least busy decides
    assert router.choose(tokens(6, 30), [a, b, c]) is a
    # a pod that has not reported its KV yet counts as having room: d wins though its working set
    # is the largest
    d = pod("d", waiting=3)
    router.working_set.remember(hashes_of(tokens(8, 20)), "d", now)
    assert router.choose(tokens(7, 4), [a, c, d]) is d


def test_working_set_forgets_after_its_window() -> None:
    a, b = pod("a"), pod("b")
    router = CacheAwareRouter(InMemoryPrefixIndex(), MODEL, BS, recent_ttl_s=0, working_set_s=0.3)
    first = router.choose(tokens(1, 4), [a, b])
    other = b if first is a else a
    assert router.choose(tokens(2, 2), [a, b]) is other  # first holds 4 blocks
    time.sleep(0.35)
    now = time.monotonic()
    assert router.working_set.blocks("a", now) == router.working_set.blocks("b", now) == 0


@pytest.mark.parametrize(
    ("busy_a", "busy_b", "expect"),
    [
        (20, 2, "b"),  # 18 > 16 apart and 20 > 1.5 x 2: out of balance
        (100, 80, "a"),  # far apart (20 > 16), but 100 < 1.5 x 80: in balance
        (10, 1, "a"),  # 10 > 1.5 x 1, but only 9 apart: in balance
        (17, 0, "b"),  # 17 > 16 and 17 > 0
        (16, 0, "a"),  # exactly the absolute threshold: not beyond it
    ],
)
def test_an_out_of_balance_load_overrides_the_prefix(
    index: InMemoryPrefixIndex, busy_a: int, busy_b: int, expect: str
) -> None:
    a, b = pod("a", running=busy_a), pod("b", outstanding=busy_b)
    ids = tokens(1, 4)
    index.apply("a", hashes_of(ids), [])
    router = CacheAwareRouter(index, MODEL, BS, balance_abs=16, balance_rel=1.5)
    assert router.choose(ids, [a, b]).address == expect
    assert router.decisions[-1].reason == ("balance" if expect == "b" else "prefix")


def test_balance_is_judged_on_the_pod_the_prefix_goes_to(index: InMemoryPrefixIndex) -> None:
    """Another pod being overloaded does not divert a request whose prefix lives on a calm pod
    (that would copy its prefix to a third pod and leave the overloaded one as it was)."""
    a, b, c = pod("a", running=5), pod("b", running=40), pod("c")
    ids = tokens(1, 4)
    index.apply("a", hashes_of(ids), [])
    router = CacheAwareRouter(index, MODEL, BS, balance_abs=16, balance_rel=1.25)
    assert router.choose(ids, [a, b, c]) is a  # b vs c is out of balance; a vs c is not
    assert router.decisions[-1].reason == "prefix"
    set_load(a, running=17)  # now a is: 17 > 16 apart and 17 > 1.25 x 0
    assert router.choose(ids, [a, b, c]) is c
    assert router.decisions[-1].reason == "balance"


def test_the_working_set_grows_by_new_prefixes_not_by_requests(index: InMemoryPrefixIndex) -> None:
    """Requests sharing a prefix add nothing to their pod's working set, whatever their own tails
    (unique, never reused): else a busy pod would look full of prefixes and new ones would spread
    by request count."""
    a, b = pod("a"), pod("b")
    router = CacheAwareRouter(index, MODEL, BS, recent_ttl_s=60)
    system = tokens(1, 4, tail=0)
    first = router.choose([*system, *tokens(2, 2)], [a, b])  # a new prefix: 6 blocks
    for i in range(10):  # 10 more of that tenant, each with 2 blocks of its own
        assert router.choose([*system, *tokens(10 + i, 2)], [a, b]) is first
    now = time.monotonic()
    assert router.working_set.blocks(first.address, now) == 6
    other = b if first is a else a
    assert router.choose(tokens(3, 2), [a, b]) is other  # a new tenant: the smaller working set
    assert router.working_set.blocks(other.address, now) == 2


def test_a_burst_sharing_a_new_prefix_lands_on_one_pod_until_recent_routes_expire(
    index: InMemoryPrefixIndex,
) -> None:
    pods = [pod("a"), pod("b"), pod("c")]
    router = CacheAwareRouter(index, MODEL, BS, recent_ttl_s=0.3)
    shared = tokens(1, 6, tail=0)  # a long system prompt nobody has cached (or published) yet
    chosen = []
    for i in range(8):
        h = router.choose([*shared, *tokens(100 + i, 1)], pods)
        h.outstanding.add(f"burst-{i}")  # what the gateway does with each request it sends
        chosen.append(h.address)
    assert len(set(chosen)) == 1, chosen
    reasons = [d.reason for d in router.decisions]
    assert reasons == ["no-match"] + ["prefix"] * 7
    assert [d.matched_blocks for d in router.decisions][1:] == [6] * 7
    # without the memory of recent routes the burst would have spread over the idler pods
    spread = CacheAwareRouter(InMemoryPrefixIndex(), MODEL, BS, recent_ttl_s=0)
    fresh = [pod("a"), pod("b"), pod("c")]
    spread_to = set()
    for i in range(3):
        h = spread.choose([*shared, *tokens(100 + i, 1)], fresh)
        h.outstanding.add(f"x-{i}")
        spread_to.add(h.address)
    assert len(spread_to) == 3

    time.sleep(0.4)  # past recent_ttl_s, and nobody published the prefix: it is forgotten
    h = router.choose([*shared, *tokens(999, 1)], pods)
    assert h.address != chosen[0]  # the idler pods win now
    assert router.decisions[-1].reason == "no-match"


def test_recent_routes_follow_one_pod_and_expire() -> None:
    r = RecentRoutes(ttl_s=1.0)
    r.remember([1, 2, 3], "a", now=0.0)
    r.remember([4], "b", now=0.0)
    assert r.match([1, 2, 3, 4], now=0.5) == ("a", 3)  # stops where the pod changes
    assert r.match([9, 1], now=0.5) == (None, 0)  # leading blocks only
    assert r.match([1, 2], now=1.5) == (None, 0)  # expired
    small = RecentRoutes(ttl_s=1.0, max_entries=2)
    small.remember([1, 2, 3], "a", now=0.0)
    assert small.match([1], now=0.0) == (None, 0) and small.match([2, 3], now=0.0) == ("a", 2)
    assert small.blocks("a", now=0.0) == 2


def test_recent_routes_count_each_block_once_on_its_latest_pod() -> None:
    r = RecentRoutes(ttl_s=1.0)
    r.remember([1, 2, 3], "a", now=0.0)
    r.remember([2, 3, 4], "b", now=0.5)  # 2 and 3 moved to b
    assert (r.blocks("a", now=0.5), r.blocks("b", now=0.5)) == (1, 3)
    assert (r.blocks("a", now=1.2), r.blocks("b", now=1.2)) == (0, 3)  # 1 expired
    assert r.blocks("b", now=1.6) == 0 and r.match([2], now=1.6) == (None, 0)


def test_the_index_is_used_alongside_recent_routes(index: InMemoryPrefixIndex) -> None:
    a, b = pod("a"), pod("b")
    ids = tokens(1, 6)
    router = CacheAwareRouter(index, MODEL, BS)
    first = router.choose(ids, [a, b])
    other = b if first is a else a
    index.apply(other.address, hashes_of(ids), [])  # the other pod publishes the whole prefix
    # first: 6 blocks from recent routes; other: 6 from the index; a tie goes to the idler
    first.outstanding.add("r1")
    assert router.choose(ids, [a, b]) is other
    assert router.decisions[-1].matched_blocks == 6


def test_an_index_nobody_listens_on_means_least_load() -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    router = CacheAwareRouter(RedisPrefixIndex(closed), MODEL, BS)
    a, b = pod("a", waiting=1), pod("b")
    assert router.choose(tokens(1, 3), [a, b]) is b
    assert router.decisions[-1].reason == "index-down"


def test_round_robin_cycles_through_the_candidates() -> None:
    pods = [pod("a", running=9), pod("b"), pod("c")]
    router = RoundRobinRouter()
    picked = [router.choose(tokens(1, 2), pods).address for _ in range(7)]
    assert picked == ["a", "b", "c", "a", "b", "c", "a"]
    assert {d.reason for d in router.decisions} == {"policy"}
    assert len(router.decisions) == 7


def test_least_load_picks_the_least_busy_and_rotates_among_ties() -> None:
    a, b, c = pod("a", waiting=2), pod("b", running=1), pod("c", running=1)
    router = LeastLoadRouter()
    picked = {router.choose(tokens(1, 2), [a, b, c]).address for _ in range(4)}
    assert picked == {"b", "c"}  # both least loaded: ties rotate, a never
    c.outstanding = {"r1", "r2", "r3"}  # sent here, not yet in its report
    assert [router.choose([], [a, b, c]).address for _ in range(3)] == ["b", "b", "b"]
    assert router.decisions[-1].reason == "policy"
