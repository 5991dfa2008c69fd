"""The radix cache's block events and the chained block hash they carry."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.common.block_hash import block_hashes, chain, root_hash
from tests.helpers.radix import make_cache, put

BS = 4


def paths(cache) -> list[np.ndarray]:
    """Every root-to-leaf token sequence in the tree."""
    out = []

    def walk(node, prefix):
        key = np.concatenate([prefix, node.key])
        if not node.children:
            out.append(key)
        for child in node.children.values():
            walk(child, key)

    for child in cache.root.children.values():
        walk(child, np.zeros(0, dtype=np.int32))
    return out


def full_blocks_in_tree(cache, model="m") -> set[int]:
    return {h for p in paths(cache) for h in block_hashes(p, model, BS)}


def replay(events, held: set[int]) -> None:
    for kind, hashes in events:
        if kind == "stored":
            assert not held & set(hashes), "a block was stored twice"
            held |= set(hashes)
        elif kind == "removed":
            assert set(hashes) <= held, "a block was removed that was never stored"
            held -= set(hashes)
        else:
            held.clear()


def test_hash_is_chained_seeded_by_model_and_ignores_a_partial_block():
    ids = list(range(40))
    h = block_hashes(ids, "model-a", 16)
    assert len(h) == 2  # 40 tokens: two full blocks of 16
    assert block_hashes(ids[:32], "model-a", 16) == h
    assert block_hashes(ids, "model-b", 16) != h  # the root is seeded by the model name
    assert chain(h[0], ids[16:32], 16) == h[1:]  # each block hashes its parent's hash
    changed = [99, *ids[1:]]
    assert block_hashes(changed, "model-a", 16)[1] != h[1]  # a block names its whole prefix


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "evict"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=24),
            st.integers(1, 30),
        ),
        max_size=30,
    ),
    page_size=st.sampled_from([1, 2, 4]),
)
def test_events_always_describe_exactly_the_full_blocks_in_the_tree(ops, page_size):
    cache = make_cache(num_pages=256 // page_size, page_size=page_size)
    cache.enable_block_events(BS, root_hash("m"))
    held: set[int] = set()
    for op, tokens, n in ops:
        if op == "put":
            tokens = tokens[: len(tokens) - len(tokens) % page_size]
            if tokens and cache.allocator.free_tokens >= len(tokens):
                put(cache, tokens)
        else:
            cache.evict(n)
        replay(cache.take_block_events(), held)
        assert held == full_blocks_in_tree(cache)
        assert sorted(held) == sorted(cache.all_block_hashes())
    cache.evict(10**6)
    replay(cache.take_block_events(), held)
    assert held == set()


def test_no_events_unless_enabled():
    cache = make_cache()
    put(cache, list(range(12)))
    assert cache.take_block_events() == [] and cache.all_block_hashes() == []
