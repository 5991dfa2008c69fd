"""The tiered cache's property test (tests/unit/test_host_tier.py) with a disk tier under the host tier:
random evictions, host evictions (which write blocks down), matches (which read them back into the
host tier) and loads. After every step the invariant holds on every tier, the disk stays within its
bound, every node's KV reads back as its tokens on each tier, and every file holds its own tokens."""

from __future__ import annotations

import shutil
import struct
import tempfile

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from radixserve.scheduler.memory.disk_store import BlockLayout, DiskStore
from radixserve.scheduler.memory.disk_tier import DiskTier
from radixserve.scheduler.memory.manager import KVCacheManager, MemoryConfig
from tests.unit.test_host_tier import TieredCacheMachine

HEADER = struct.calcsize("<4sHQQIQIHH")  # the file header (memory/disk_store.py)


class DiskCacheMachine(TieredCacheMachine):
    @initialize(
        page=st.sampled_from([1, 2, 4]),
        pages=st.integers(10, 24),
        host_pages=st.integers(4, 16),
        disk_blocks=st.integers(1, 12),
        write_through=st.booleans(),
    )
    def setup(self, page, pages, host_pages, disk_blocks, write_through):
        bs = 2 * page
        layout = BlockLayout((1, bs, 1, 1), torch.int64)  # the fake KV: a token id per slot
        self.dir = tempfile.mkdtemp(prefix="disk-machine-")
        self.tier = DiskTier(DiskStore(self.dir, disk_blocks * layout.file_bytes, layout, 99), bs)
        mem = MemoryConfig(max_total_tokens=pages * page, page_size=page, host_kv_tokens=host_pages * page,
                           kv_write_through=write_through, disk=self.tier)  # fmt: skip
        self.kv = KVCacheManager(mem)
        assert self.kv.host is not None
        self.page = page
        self.dev = np.full(self.kv.allocator.pool_slots, -1, dtype=np.int64)
        self.host_tensor = torch.full((self.kv.host.pool_slots, 1, 1), -1, dtype=torch.int64)
        self.host = self.host_tensor.numpy().reshape(-1)
        self.locked: list = []

    def _load(self, seq):
        self.kv.cache.read_disk(seq)  # what is on disk past the tree's match: a read, taken next step
        return super()._load(seq)

    def _copies(self):
        self.tier.flush()  # the reads the last matches submitted ...
        self.kv.poll()  # ... become host-only nodes, their fills queued
        t = self.kv.cache.take_transfers()
        if t is not None:
            if len(t.disk_seq):  # captures, then fills, before the write-backs and loads
                self.tier.run_step(int(t.disk_seq[0]), [self.host_tensor])
            self.host[t.store_dst] = self.dev[t.store_src]
            self.dev[t.load_dst] = self.host[t.load_src]

    @invariant()
    def files_hold_their_tokens(self):
        if not hasattr(self, "kv") or self.locked:
            return
        self.tier.check()  # within the bound, the index's files there
        for h in self.tier.store.hashes():
            raw = self.tier.store.file(h).read_bytes()
            n = struct.unpack_from("<I", raw, 22)[0]
            ids = np.frombuffer(raw, dtype="<i4", count=n, offset=HEADER)
            kv = np.frombuffer(raw, dtype=np.int64, offset=HEADER + 4 * n)
            assert np.array_equal(kv, ids), f"block {h:x} holds another block's KV"

    def teardown(self):
        if hasattr(self, "kv"):
            super().teardown()
            self.tier.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TestDiskCache = DiskCacheMachine.TestCase
TestDiskCache.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
