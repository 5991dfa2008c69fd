import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.scheduler.memory.no_cache import NoCache
from tests.helpers.radix import make_cache, put


def test_match_finds_the_longest_prefix_and_splits_inside_a_node():
    c = make_cache()
    put(c, [1, 2, 3, 4, 5])
    put(c, [1, 2, 9])
    m = c.match_prefix(np.array([1, 2, 3, 4, 7]))
    assert len(m.slots) == 4
    # That match ended inside the node [3, 4, 5]: it is split so [3, 4] can be locked alone.
    assert len(m.node) == 2 and m.node.key.tolist() == [3, 4]
    assert c.total_size == 6  # a split moves no tokens
    assert len(c.match_prefix(np.array([1, 2, 3, 4, 5, 6])).slots) == 5
    assert len(c.match_prefix(np.array([8, 1])).slots) == 0


def test_match_returns_the_slots_that_were_inserted():
    c = make_cache()
    res = put(c, [5, 6, 7])
    m = c.match_prefix(np.array([5, 6, 7]))
    assert np.array_equal(m.slots, res.slots)


def test_page_aligned_match_ignores_a_partial_last_page():
    c = make_cache(page_size=4)
    put(c, list(range(12)))
    assert len(c.match_prefix(np.arange(11)).slots) == 8  # 11 tokens: two whole pages
    q = np.array([0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11])
    assert len(c.match_prefix(q).slots) == 4  # differs inside page 2: only page 1 matches
    with pytest.raises(ValueError):
        c.insert(np.arange(6, dtype=np.int32), np.arange(6))


def test_insert_reports_what_was_already_present():
    c = make_cache()
    put(c, [1, 2, 3])
    res = put(c, [1, 2, 3, 4, 5])
    assert res.present_len == 3 and len(res.slots) == 5
    assert c.evictable_size == 5


def test_locked_prefixes_are_never_evicted():
    c = make_cache()
    a = put(c, [1, 2, 3, 4])
    put(c, [1, 2, 7, 8])
    c.lock(a.node)
    assert c.protected_size == 4 and c.evictable_size == 2
    assert c.evict(100) == 2  # only the unlocked branch goes
    assert len(c.match_prefix(np.array([1, 2, 3, 4])).slots) == 4
    assert len(c.match_prefix(np.array([1, 2, 7, 8])).slots) == 2
    c.unlock(a.node)
    assert c.protected_size == 0 and c.evictable_size == 4
    with pytest.raises(RuntimeError):
        c.unlock(a.node)


def test_evict_is_lru_and_parents_follow_their_last_child():
    c = make_cache()
    put(c, [1, 2, 3])
    put(c, [1, 2, 4])
    put(c, [5, 6])
    c.match_prefix(np.array([1, 2, 3]))  # touch: [1,2,3] is now the most recent
    free_before = c.allocator.free_tokens
    assert c.evict(1) == 1  # [4] is the least recently used leaf
    assert c.evict(1) == 2  # then [5, 6]
    assert c.evict(2) == 3  # then [3], after which [1, 2] is a leaf and goes too
    assert c.total_size == 0 and c.allocator.free_tokens == free_before + 6


def test_prefixes_waiting_requests_want_are_evicted_after_everything_else():
    c = make_cache()
    put(c, [1, 2, 3])
    put(c, [5, 6])
    put(c, [7, 8, 9])
    m = c.match_prefix(np.array([1, 2]))  # a waiting request's match: splits off [3]
    c.want([m.node])
    c.match_prefix(np.array([5, 6]))  # the others are used more recently than [1, 2]
    c.match_prefix(np.array([7, 8, 9]))
    assert c.wanted_evictable_size() == 2
    assert c.evict(1) == 1  # [3]: not wanted, least recent; [1, 2] is a leaf now but wanted
    assert c.evict(3) == 5  # [5, 6] and [7, 8, 9] go before the older [1, 2]
    assert len(c.match_prefix(np.array([1, 2, 4])).slots) == 2
    c.lock(m.node)
    assert c.wanted_evictable_size() == 0  # locked: not evictable at all
    c.unlock(m.node)
    assert c.evict(100) == 2 and c.total_size == 0  # wanted is a preference, not a lock
    assert not c.wanted


def test_a_split_keeps_the_wanted_mark_on_both_halves():
    c = make_cache()
    put(c, [1, 2, 3, 4])
    c.want([c.match_prefix(np.array([1, 2, 3, 4])).node])
    c.match_prefix(np.array([1, 2, 9]))  # splits [1, 2, 3, 4] after [1, 2]
    assert c.wanted_evictable_size() == 4
    c.want([])
    assert c.wanted_evictable_size() == 0


def test_disabled_cache_has_the_same_interface_and_never_matches():
    c = make_cache(cls=NoCache)
    assert len(c.match_prefix(np.array([1, 2, 3])).slots) == 0
    assert c.evict(10) == 0 and c.evictable_size == 0 and c.protected_size == 0


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=24)


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(tokens, min_size=1, max_size=12), query=tokens, page_size=st.sampled_from([1, 2, 4]))
def test_match_is_the_longest_page_aligned_common_prefix_of_what_was_inserted(seqs, query, page_size):
    c = make_cache(num_pages=400, page_size=page_size)
    for s in seqs:
        s = s[: len(s) - len(s) % page_size]
        if s:
            put(c, s)

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n - n % page_size

    expect = max(lcp(query, s) for s in seqs)
    m = c.match_prefix(np.array(query, dtype=np.int32))
    assert len(m.slots) == expect
    # and the slots are the ones of the path it claims
    again = c.match_prefix(np.array(query[:expect], dtype=np.int32))
    assert np.array_equal(again.slots, m.slots)
