import numpy as np
import pytest

from radixserve.scheduler.memory.allocator import (
    OutOfPagesError,
    PagedAllocator,
    capacity_from_memory,
    kv_bytes_per_token,
)
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool


def test_alloc_hands_out_distinct_pages_and_never_the_scratch_page():
    a = PagedAllocator(num_pages=10, page_size=4)
    pages = np.concatenate([a.alloc_pages(3), a.alloc_pages(7)])
    assert sorted(pages.tolist()) == list(range(1, 11))
    assert a.num_free_pages == 0 and a.free_tokens == 0
    assert a.pool_slots == 44  # 10 pages + the scratch page


def test_alloc_more_than_free_raises():
    a = PagedAllocator(num_pages=2, page_size=1)
    a.alloc_pages(2)
    with pytest.raises(OutOfPagesError):
        a.alloc_pages(1)


def test_double_free_and_foreign_pages_are_rejected():
    a = PagedAllocator(num_pages=4, page_size=2)
    p = a.alloc_pages(2)
    a.free_pages(p)
    with pytest.raises(ValueError, match="double free"):
        a.free_pages(p[:1])
    with pytest.raises(ValueError):
        a.free_pages(np.array([0]))  # the scratch page
    with pytest.raises(ValueError):
        a.free_pages(np.array([5]))
    q = a.alloc_pages(1)
    with pytest.raises(ValueError, match="double free"):
        a.free_pages(np.array([q[0], q[0]]))
    assert a.num_free_pages == 3


def test_free_returns_capacity_and_slots_follow_pages():
    a = PagedAllocator(num_pages=8, page_size=4)
    p = a.alloc_pages(3)
    slots = a.pages_to_slots(p)
    assert len(slots) == 12
    assert np.array_equal(slots[:4], np.arange(p[0] * 4, p[0] * 4 + 4))
    a.free_slots(slots)
    assert a.free_tokens == a.capacity_tokens == 32


def test_capacity_from_memory_fraction():
    per_tok = kv_bytes_per_token(num_layers=28, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert per_tok == 114688  # Qwen3-0.6B shapes in bf16: 112 KiB per token
    tokens = capacity_from_memory(80 * 2**30, 0.5, per_tok, page_size=16)
    assert tokens % 16 == 0
    assert (tokens + 16) * per_tok <= 40 * 2**30 < (tokens + 32) * per_tok
    with pytest.raises(ValueError):
        capacity_from_memory(1000, 0.5, per_tok, 16)
    with pytest.raises(ValueError):
        capacity_from_memory(2**30, 1.5, per_tok, 16)


def test_req_to_token_rows_are_exclusive():
    pool = ReqToTokenPool(max_running=2, max_context=8)
    r0, r1 = pool.alloc(), pool.alloc()
    assert r0 != r1 and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.alloc()
    pool.write(r0, 2, np.array([7, 8, 9]))
    assert pool.read(r0, 2, 5).tolist() == [7, 8, 9]
    with pytest.raises(ValueError):
        pool.write(r1, 6, np.array([1, 2, 3]))  # past max_context
    pool.free(r0)
    with pytest.raises(ValueError):
        pool.free(r0)
