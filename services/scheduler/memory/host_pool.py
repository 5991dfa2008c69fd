"""HostKVPool: the host tier's K and V tensors (docs/architecture.md, "KV tiers"), and the copies between it
and the device's KVPool that the radix cache queues (``KVTransfers``), run before a step's forward.

Same layout as KVPool (per layer, ``[slots, kv_heads, head_dim]``), host slots in pages of the
device's page size; which pages hold what is the radix cache's business (its host allocator).

CPU: plain memory; the copies run synchronously, write-backs first, then loads.

CUDA: pinned memory, so that copies are asynchronous DMA. The copies run on a side stream that first
waits for the forward stream (the pages a write-back reads were written by earlier forwards). The
forward stream waits for the write-backs' event before the forward (it may overwrite the pages they
read), but not for the loads': the request a load is for waits a step (policy/prefill_adder.py), so
the step's forward runs beside its loads, and the next step's forward waits for them
(``wait_loads``). Only a batch that reads pages its own step loads (``KVTransfers.load_sync``: a
request admitted at once, with nothing else to run) waits for its loads. Each direction is one
transfer per step: the pages are gathered into one contiguous buffer (on the device for write-backs,
in pinned memory for loads), copied once, and scattered. A write-back lands in the host pool (a
host-side scatter) at the start of the next step's copies, when its transfer is long done, so the
scheduler thread does not wait for it; a load in the same step that reads a page just written back
waits for it first.

A step's loads are timed into its ``KVLoad`` (metrics and traces read it once the step is done):
on CPU the copies' wall time; on CUDA the host-side gather's wall time plus the device time between
two events on the side stream around the transfer and the scatter, read only once the end event
has fired (``KVLoad.seconds`` never waits for it: None until then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from radixserve.scheduler.memory.disk_follower import DiskFollower
from radixserve.scheduler.memory.disk_tier import DiskTier
from radixserve.scheduler.memory.kv_pool import (
    KVPool,
    gather_slots,
    scatter_slots,
    slot_index,
    slots_to_device,
)
from radixserve.scheduler.memory.tiered_cache import KVTransfers


@dataclass(slots=True, eq=False)
class KVLoad:
    """One step's load-back: ``tokens`` KV slots copied from a lower tier to the device, ``nbytes``
    over every rank (tensor parallelism: each rank copies its own heads), timed by the pool."""

    tokens: int
    nbytes: int
    from_tier: str = "host"
    start: float | None = None  # time.perf_counter() when the copies began (CUDA: were queued)
    _seconds: float | None = None
    _events: tuple[float, torch.cuda.Event, torch.cuda.Event] | None = None  # host seconds, begin, end

    def timed(self, start: float, seconds: float) -> None:
        self.start, self._seconds = start, seconds

    def timed_on_device(
        self, start: float, host_s: float, begin: torch.cuda.Event, end: torch.cuda.Event
    ) -> None:
        self.start, self._events = start, (host_s, begin, end)

    def seconds(self) -> float | None:
        """How long the copies took; None while that is not known yet (CUDA: the copies' end event
        has not fired). Never blocks: a step reads it after its results, when the copies are done."""
        if self._seconds is None and self._events is not None:
            host_s, begin, end = self._events
            if end.query():
                self._seconds, self._events = host_s + begin.elapsed_time(end) / 1e3, None
        return self._seconds


class HostKVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``device``: the device pool's device (CUDA: the host memory is pinned, the copies async)."""
        self.cuda = device.type == "cuda"
        self.device = device
        shape = (num_slots, num_kv_heads, head_dim)
        self.tensors = [
            torch.zeros(shape, dtype=dtype, pin_memory=self.cuda) for _ in range(2 * num_layers)
        ]  # K of every layer, then V
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.bytes_per_slot = self.nbytes // num_slots  # one token's K and V over every layer
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # CUDA: a write-back whose transfer is queued: (its done event, the pinned buffer, host slots)
        self._landing: tuple[torch.cuda.Event, torch.Tensor, torch.Tensor] | None = None
        self._loaded: torch.cuda.Event | None = None  # CUDA: the last loads no forward has waited for
        # the disk tier under this pool (the engine attaches it; a tensor-parallel follower its side)
        self.disk: DiskTier | DiskFollower | None = None

    def wait_loads(self) -> None:
        """CUDA: the forward stream waits for the loads of earlier steps (before every forward: their
        requests join this step, and their pages may be this step's to write). CPU: nothing."""
        if self._loaded is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded)
            self._loaded = None

    def run(self, pool: KVPool, t: KVTransfers, load: KVLoad | None = None) -> None:
        """The step's copies: ``t.store_src`` device slots to ``t.store_dst`` host slots, then
        ``t.load_src`` host slots to ``t.load_dst`` device slots (timed into ``load``, if given).
        CUDA: the forward stream waits for the write-backs, and for the loads only with
        ``t.load_sync`` (else ``wait_loads`` does, before the next forward)."""
        dev = [*pool.k, *pool.v]
        if not self.cuda:
            self._disk_step(t)
            if len(t.store_src):
                scatter_slots(
                    self.tensors, slot_index(t.store_dst), gather_slots(dev, slot_index(t.store_src))
                )
            if len(t.load_src):
                start = time.perf_counter()
                scatter_slots(dev, slot_index(t.load_dst), gather_slots(self.tensors, slot_index(t.load_src)))
                if load is not None:
                    load.timed(start, time.perf_counter() - start)
            return
        self._land()  # the last step's write-back, before anything reads or rewrites those pages
        self._disk_step(t)
        assert self.stream is not None
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            if len(t.store_src):
                src = slots_to_device(t.store_src, self.device)
                gathered = torch.stack([*gather_slots(dev, src)])  # [2L, n, heads, dim]
                staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                staging.copy_(gathered, non_blocking=True)  # one device -> host transfer
                stored = torch.cuda.Event()
                stored.record(self.stream)
                main.wait_event(stored)  # the forward may overwrite the pages it reads
                self._landing = (stored, staging, slot_index(t.store_dst))
                if len(t.load_src):
                    self._land()  # a load may read a page this write-back fills: land it first
            if len(t.load_src):
                self._load(dev, t, load)
                loaded = torch.cuda.Event()
                loaded.record(self.stream)
                if len(t.load_sync):
                    main.wait_event(loaded)  # this batch reads pages they write
                else:
                    self._loaded = loaded  # the side stream runs in order: it covers earlier loads

    def _load(self, dev: list[torch.Tensor], t: KVTransfers, load: KVLoad | None) -> None:
        """CUDA, on the side stream: gather the loads' host pages into pinned memory (on this
        thread), one transfer, a scatter into the device pool; timed into ``load``."""
        start = time.perf_counter()
        src = slot_index(t.load_src)
        staging = torch.empty(
            (len(self.tensors), len(src), *self.tensors[0].shape[1:]),
            dtype=self.tensors[0].dtype,
            pin_memory=True,
        )
        torch.stack([*gather_slots(self.tensors, src)], out=staging)
        host_s = time.perf_counter() - start
        events = None
        if load is not None:  # the device part: read later, without waiting (KVLoad.seconds)
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record(self.stream)
        loaded = staging.to(self.device, non_blocking=True)  # one host -> device transfer
        scatter_slots(dev, slots_to_device(t.load_dst, self.device), loaded)
        if load is not None and events is not None:
            events[1].record(self.stream)
            load.timed_on_device(start, host_s, *events)

    def _disk_step(self, t: KVTransfers) -> None:
        """The disk tier's captures (host pages about to be reused) and fills (pages loads may read)
        for this step, before its write-backs and loads (memory/disk_tier.py)."""
        if len(t.disk_seq):
            assert self.disk is not None, "disk-tier copies without a disk tier"
            self.disk.run_step(int(t.disk_seq[0]), self.tensors)

    def _land(self) -> None:
        """Scatter a queued write-back into the host pool (waits for its transfer)."""
        if self._landing is None:
            return
        event, staging, dst = self._landing
        self._landing = None
        event.synchronize()
        scatter_slots(self.tensors, dst, staging)

    def synchronize(self) -> None:
        """Every queued copy done, write-backs landed (tests, shutdown)."""
        if self.stream is not None:
            self.stream.synchronize()
        self._loaded = None
        self._land()
