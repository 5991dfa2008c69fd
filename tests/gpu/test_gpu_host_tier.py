"""CUDA tests of the host KV tier (docs/architecture.md, "KV tiers"): pinned host pages, the copies on
their own stream, and the engine with the tier on. The CPU side (the tree, the accounting, the copies
run synchronously) is tested in tests/unit/test_host_tier.py.

Skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.host_pool import HostKVPool
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.tiered_cache import KVTransfers
from tests.helpers.host_tier import PREFIX, engine_turns

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
EMPTY = np.zeros(0, dtype=np.int64)


def _slots(pages: list[int], page: int = 16) -> np.ndarray:
    return PagedAllocator(64, page).pages_to_slots(np.array(pages, dtype=np.int64))


def test_host_pages_are_pinned_and_round_trip_byte_exact_through_the_side_stream():
    layers, heads, dim = 4, 2, 64
    pool = KVPool(65 * 16, layers, heads, dim, torch.bfloat16, DEV)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, device=DEV).to(torch.bfloat16))
    want = [t[torch.as_tensor(_slots([3, 9, 10]), device=DEV)].clone() for t in (*pool.k, *pool.v)]
    host = HostKVPool(33 * 16, layers, heads, dim, torch.bfloat16, DEV)
    assert all(t.is_pinned() for t in host.tensors)
    # one step writes back pages 3, 9, 10 to host pages 5, 1, 2 and, in the same step, loads host
    # page 1 (just written back) into device page 20: the write-back lands before the load reads it
    host.run(pool, KVTransfers(_slots([3, 9, 10]), _slots([5, 1, 2]), _slots([1]), _slots([20])))
    # the next step's forward overwrites the written-back device pages; the copies ran before it
    for t in (*pool.k, *pool.v):
        t.index_fill_(0, torch.as_tensor(_slots([3, 9, 10]), device=DEV), 0)
    host.run(pool, KVTransfers(EMPTY, EMPTY, _slots([5, 1, 2]), _slots([30, 31, 32])))
    torch.cuda.current_stream().synchronize()
    back = torch.as_tensor(_slots([30, 31, 32]), device=DEV)
    same_step = torch.as_tensor(_slots([20]), device=DEV)
    for t, w in zip((*pool.k, *pool.v), want, strict=True):
        assert torch.equal(t[back].view(torch.int16), w.view(torch.int16))
        assert torch.equal(t[same_step].view(torch.int16), w[16:32].view(torch.int16))


def test_engine_greedy_tokens_are_the_same_with_the_host_tier_on_cuda(demo_model):
    path = demo_model("llama")
    opts = dict(device="cuda", dtype="float32", attention_backend="torch")
    off, _ = engine_turns(path, host_kv_cache_gb=0.0, disable_overlap=True, **opts)
    on, s = engine_turns(path, host_kv_cache_gb=0.01, disable_overlap=False, **opts)
    assert [[o["token_ids"] for o in t] for t in on] == [[o["token_ids"] for o in t] for t in off]
    assert s.kv.cache.loaded_tokens >= 3 * PREFIX


def test_engine_greedy_tokens_are_the_same_with_the_disk_tier_on_cuda_and_a_restart_starts_warm(
    demo_model, tmp_path
):
    path = demo_model("llama")
    opts = dict(device="cuda", dtype="float32", attention_backend="torch")
    disk = dict(host_kv_cache_gb=0.00004, kv_disk_cache_dir=str(tmp_path))  # a host tier of ~76 tokens
    off, _ = engine_turns(path, host_kv_cache_gb=0.0, disable_overlap=True, **opts)
    on, s = engine_turns(path, disable_overlap=False, **disk, **opts)
    want = [[o["token_ids"] for o in t] for t in off]
    assert [[o["token_ids"] for o in t] for t in on] == want
    assert s.kv.cache.disk.written_tokens > 0 and s.kv.cache.disk.read_tokens > 0
    again, _ = engine_turns(path, disable_overlap=False, **disk, **opts)
    assert [[o["token_ids"] for o in t] for t in again] == want
    assert again[0][0]["meta_info"]["cached_tokens"] > 0
