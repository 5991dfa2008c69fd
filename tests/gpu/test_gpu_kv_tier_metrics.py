"""CUDA: a step's load-back is timed by two events on the host pool's side stream, and its time is read
without waiting for them (KVLoad.seconds: None until the end event fired). The CPU side is tested in
tests/unit/test_kv_tier_metrics.py.

Skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.scheduler.memory.allocator import PagedAllocator
from radixserve.scheduler.memory.host_pool import HostKVPool, KVLoad
from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.tiered_cache import KVTransfers

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
EMPTY = np.zeros(0, dtype=np.int64)


def test_a_loads_seconds_come_from_its_events_once_fired_and_the_pages_arrive():
    page, layers, heads, dim = 16, 8, 4, 128
    pool = KVPool(257 * page, layers, heads, dim, torch.bfloat16, DEV)
    host = HostKVPool(129 * page, layers, heads, dim, torch.bfloat16, DEV)
    for t in host.tensors:
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    src = PagedAllocator(128, page).pages_to_slots(np.arange(1, 65, dtype=np.int64))
    dst = PagedAllocator(256, page).pages_to_slots(np.arange(101, 165, dtype=np.int64))
    load = KVLoad(len(src), len(src) * host.bytes_per_slot)
    host.run(pool, KVTransfers(EMPTY, EMPTY, src, dst), load)
    early = load.seconds()  # never waits: None while the copies may still run
    assert early is None or early > 0
    torch.cuda.synchronize()
    seconds = load.seconds()
    assert seconds is not None and seconds > 0 and load.start is not None
    index = torch.as_tensor(src)
    for h, d in zip(host.tensors, (*pool.k, *pool.v), strict=True):
        assert torch.equal(
            d[torch.as_tensor(dst, device=DEV)].cpu().view(torch.int16), h[index].view(torch.int16)
        )
    print(f"load-back of {len(src)} tokens ({load.nbytes / 2**20:.1f} MiB): {seconds * 1e3:.3f} ms")
