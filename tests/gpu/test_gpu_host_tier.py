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
    host.wait_loads()  # as the next forward does: these loads' batch did not wait for them
    torch.cuda.current_stream().synchronize()
    back = torch.as_tensor(_slots([30, 31, 32]), device=DEV)
    same_step = torch.as_tensor(_slots([20]), device=DEV)
    for t, w in zip((*pool.k, *pool.v), want, strict=True):
        assert torch.equal(t[back].view(torch.int16), w.view(torch.int16))
        assert torch.equal(t[same_step].view(torch.int16), w[16:32].view(torch.int16))


def _busy_side_stream(host: HostKVPool) -> torch.cuda.Event:
    """Keep ``host``'s side stream busy for a while (it waits for matrix products on a third stream):
    its copies then cannot be done before the forward stream gets past them, unless it waits for
    them. Returns the event that ends the work."""
    busy = torch.cuda.Stream(DEV)
    with torch.cuda.stream(busy):
        x = torch.randn(4096, 4096, device=DEV)
        for _ in range(100):  # about 14 TFLOP: a large fraction of a second on any GPU
            x = torch.tanh(x @ x)
        gate = torch.cuda.Event()
        gate.record(busy)
    assert host.stream is not None
    host.stream.wait_event(gate)
    return gate


@pytest.mark.parametrize("sync", [False, True], ids=["beside", "waited"])
def test_the_forward_stream_waits_for_a_steps_loads_only_when_its_batch_reads_them(sync):
    layers, heads, dim = 2, 2, 64
    pool = KVPool(65 * 16, layers, heads, dim, torch.bfloat16, DEV)
    host = HostKVPool(33 * 16, layers, heads, dim, torch.bfloat16, DEV)
    for t in host.tensors:
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    gate = _busy_side_stream(host)
    flag = np.ones(1, dtype=np.int64) if sync else EMPTY
    host.run(pool, KVTransfers(EMPTY, EMPTY, _slots([1, 2]), _slots([40, 41]), EMPTY, flag))
    main = torch.cuda.current_stream(DEV)
    forward = torch.cuda.Event()
    forward.record(main)  # where this step's forward would start
    if sync:  # the batch reads the loaded pages: its forward starts after the loads
        forward.synchronize()
        assert gate.query()
    else:  # the forward starts while the loads still wait on the side stream
        forward.synchronize()
        assert not gate.query(), "the forward stream waited for loads its batch does not read"
        host.wait_loads()  # the next step's forward waits for them
        nxt = torch.cuda.Event()
        nxt.record(main)
        nxt.synchronize()
        assert gate.query()
    src, dst = torch.as_tensor(_slots([1, 2])), torch.as_tensor(_slots([40, 41]), device=DEV)
    for h, d in zip(host.tensors, (*pool.k, *pool.v), strict=True):
        assert torch.equal(d[dst].cpu().view(torch.int16), h[src].view(torch.int16))


def test_engine_greedy_tokens_are_the_same_with_the_host_tier_on_cuda(demo_model):
    path = demo_model("llama")
    opts = dict(device="cuda", dtype="float32", attention_backend="torch")
    off, _ = engine_turns(path, host_kv_cache_gb=0.0, disable_overlap=True, **opts)
    on, s = engine_turns(path, host_kv_cache_gb=0.01, disable_overlap=False, **opts)
    assert [[o["token_ids"] for o in t] for t in on] == [[o["token_ids"] for o in t] for t in off]
    assert s.kv.cache.loaded_tokens >= 3 * PREFIX


def test_a_hybrid_engine_resumes_host_prefixes_from_their_snapshots_on_cuda(demo_model):
    """Qwen3.5 (linear-attention layers): a prefix loaded back from the host resumes from its node's
    state snapshot (memory/hybrid_tiered_cache.py), on the device or loaded back from a host snapshot
    slot; the KV loads waited for a step, as on CUDA always."""
    path = demo_model("qwen3_5")
    opts = dict(device="cuda", dtype="float32", attention_backend="torch")
    off, _ = engine_turns(path, host_kv_cache_gb=0.0, disable_overlap=True, **opts)
    on, s = engine_turns(path, host_kv_cache_gb=0.01, disable_overlap=False, **opts)
    assert [[o["token_ids"] for o in t] for t in on] == [[o["token_ids"] for o in t] for t in off]
    assert s.kv.cache.loaded_tokens >= 3 * PREFIX and s.kv.hit_tokens["host"] >= 3 * PREFIX
    # Four device snapshot slots: those the device evicts go to the host snapshot slots (pinned) and
    # come back (memory/host_state_pool.py's CUDA path), before the inits that read them.
    few, s4 = engine_turns(path, host_kv_cache_gb=0.01, max_state_snapshots=4, disable_overlap=False, **opts)
    assert [[o["token_ids"] for o in t] for t in few] == [[o["token_ids"] for o in t] for t in off]
    assert s4.kv.cache.stored_snapshots > 0 and s4.kv.cache.loaded_snapshots > 0


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
