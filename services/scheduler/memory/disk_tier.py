"""DiskTier: the disk KV tier's threads and the copies between it and the host pool
(docs/architecture.md, "KV tiers"); the files themselves are memory/disk_store.py's.

Writing down: the cache (memory/disk_cache.py) queues a *capture* of host pages when the host tier
drops a node; the step's copies run it first (``run_step``: on the runner's thread, before any of
that step's copies rewrite those pages), gathering the pages into one tensor, and a writer thread
writes its blocks' files. Reading: the cache submits a *read* of blocks a prompt hits on disk; a
reader thread reads and checks the files (a bad one is a counted miss) and the cache takes the
result on its next ``poll``: new host pages and a *fill* of them, which the step's copies run after
the captures and before the loads to the device. Neither thread ever touches the pools.

Tensor parallelism (``store.tp`` > 1): this tier is rank 0's; its reader reads and checks every
rank's part of a block (one node, one directory), and a fill holds every rank's heads. Before each
step's plan, rank 0 sends each follower its ``RankDiskOps`` (``follower_ops``: the captures, and its
heads of the fills; tensor_parallel.py), and each rank writes its own part of a captured block
(memory/disk_follower.py on ranks > 0).

A disk that refuses a write (full, read-only, or a bound smaller than one block) turns the tier off
with one warning: no more reads or writes, requests go on with the host tier alone.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt
import torch

from radixserve.scheduler.memory.disk_store import DiskStore
from radixserve.scheduler.memory.kv_pool import gather_slots, scatter_slots

log = logging.getLogger(__name__)

# Captured KV waiting for the writer beyond this is dropped, not queued (a disk slower than eviction).
MAX_PENDING_WRITE_BYTES = 1 << 30

Capture = tuple[npt.NDArray[np.int64], list[tuple[int, npt.NDArray[np.int32]]]]  # host slots, blocks
# host slots, their KV [2L, n, heads, dim] (tensor parallelism: every rank's heads, rank 0's first)
Fill = tuple[npt.NDArray[np.int64], torch.Tensor]
Blocks = list[tuple[int, npt.NDArray[np.int32]]]  # (hash, token ids) of each block a capture holds


class CaptureWriter:
    """A writer thread for captured KV with a bounded backlog (rank 0's ``DiskTier`` and a
    follower's ``DiskFollower`` alike): ``submit`` gathers a capture's host pages now (before the
    step's copies may rewrite them) and queues ``write(blocks, kv)``, or drops the capture when the
    backlog is past ``MAX_PENDING_WRITE_BYTES`` (a disk slower than eviction: a later miss, never a
    wrong block)."""

    def __init__(self, write: Callable[[Blocks, torch.Tensor], None]) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-write")

    def submit(self, slots: npt.NDArray[np.int64], blocks: Blocks, tensors: list[torch.Tensor]) -> bool:
        """Queue the capture of host ``slots``; False: dropped (the backlog is full: sized before the
        copy, so a dropped capture costs the step nothing)."""
        nbytes = len(slots) * sum(t[0].numel() * t.element_size() for t in tensors)
        with self._lock:
            if self._pending_bytes + nbytes > MAX_PENDING_WRITE_BYTES:
                return False
            self._pending_bytes += nbytes
        kv = torch.stack([*gather_slots(tensors, torch.from_numpy(slots))])  # [2L, n, heads, dim]
        self._pool.submit(self._run, blocks, kv, nbytes)
        return True

    def _run(self, blocks: Blocks, kv: torch.Tensor, nbytes: int) -> None:
        try:
            self._write(blocks, kv)
        finally:
            with self._lock:
                self._pending_bytes -= nbytes

    def flush(self) -> None:
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(slots=True)
class ReadJob:
    """Blocks ``hashes`` of ``tokens`` (the prompt up to their end), the first starting at ``start``."""

    tokens: npt.NDArray[np.int32]
    start: int
    hashes: list[int]


@dataclass(slots=True)
class ReadResult:
    job: ReadJob
    blocks: int  # how many blocks, from the first, read and checked
    kv: torch.Tensor | None  # their KV, [2L, blocks * block_size, heads, dim]


@dataclass(slots=True)
class StepOps:
    captures: list[Capture] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RankDiskOps:
    """One step's disk ops for one follower rank: the captures (its part of each block to write) and
    its heads of the fills; rank 0 sends it before the step's plan (tensor_parallel.py)."""

    seq: int
    root_hash: int  # the model's, for the files' headers (block events may set it after start)
    captures: list[Capture]
    fills: list[Fill]


class DiskTier:
    def __init__(self, store: DiskStore, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.off = False  # a disk that refused a write: no more disk (one warning)
        self.written_tokens = 0
        self.read_tokens = 0
        self.dropped_writes = 0  # captures dropped: the writer was too far behind
        self.misses: Counter[str] = Counter()
        self.reading: set[int] = set()  # block hashes a submitted read has not returned yet (cache)
        self._lock = threading.Lock()
        self._sealed: dict[int, StepOps] = {}  # step ops by sequence number, cache -> runner
        self._seq = 0
        self._done: queue.SimpleQueue[ReadResult] = queue.SimpleQueue()
        self._landed = threading.Event()  # a read was put in _done (await_read)
        self._removed: list[int] = []  # files deleted (LRU, bad): hashes for "removed" events
        self._writer = CaptureWriter(self._write)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-read")

    # -------------------------------------------------------- the cache's side
    def rehash(self, block_size: int, root_hash: int) -> None:
        """Blocks of ``block_size`` from the model root ``root_hash`` (the block events'), before any."""
        self.block_size = block_size
        shape = self.store.layout.shape
        self.store.layout = replace(self.store.layout, shape=(shape[0], block_size, shape[2], shape[3]))
        self.store.root_hash = root_hash

    def seal(self, ops: StepOps) -> int:
        """Hand a step's captures and fills over to the runner; returns their sequence number."""
        with self._lock:
            self._seq += 1
            self._sealed[self._seq] = ops
            return self._seq

    def follower_ops(self, seq: int) -> list[RankDiskOps]:
        """Step ``seq``'s ops for ranks 1..tp-1, each with its own heads of the fills (the scheduler
        thread, before the runner's ``run_step`` takes them)."""
        with self._lock:
            ops = self._sealed[seq]
        heads = self.store.layout.shape[2]
        return [
            RankDiskOps(
                seq,
                self.store.root_hash,
                [] if self.off else ops.captures,
                [(slots, kv[:, :, r * heads : (r + 1) * heads].contiguous()) for slots, kv in ops.fills],
            )
            for r in range(1, self.store.tp)
        ]

    def submit_read(self, job: ReadJob) -> None:
        self.reading.update(job.hashes)
        self._reader.submit(self._read, job)

    def take_done(self) -> list[ReadResult]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def await_read(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for a read in flight to land; at once when none is in flight
        or one has landed already."""
        if self.reading and self._done.empty():
            self._landed.wait(timeout_s)
        self._landed.clear()

    def take_removed(self) -> list[int]:
        with self._lock:
            out, self._removed = self._removed, []
        return out

    # ------------------------------------------------------- the runner's side
    def run_step(self, seq: int, tensors: list[torch.Tensor]) -> None:
        """Step ``seq``'s captures (gathered now, written by the writer thread), then its fills, into
        the host pool's ``tensors`` (K of every layer, then V)."""
        with self._lock:
            ops = self._sealed.pop(seq)
        for slots, blocks in ops.captures:
            if self.off:
                break
            if not self._writer.submit(slots, blocks, tensors):
                self.dropped_writes += len(blocks)
        run_fills(ops.fills, tensors)

    # -------------------------------------------------------------- threads
    def _write(self, blocks: Blocks, kv: torch.Tensor) -> None:
        bs = self.block_size
        try:
            for i, (h, tokens) in enumerate(blocks):
                if self.off:
                    return
                evicted = self.store.write(h, tokens, kv[:, i * bs : (i + 1) * bs])
                if evicted is None:
                    continue  # on disk already (written by another scheduler since the capture)
                with self._lock:
                    self._removed.extend(evicted)
                self.written_tokens += bs
        except OSError as e:  # full, read-only, or a bound smaller than one block
            self.turn_off(f"writing {self.store.path}: {e}")

    def _read(self, job: ReadJob) -> None:
        bs, kvs = self.block_size, []
        try:
            for i, h in enumerate(job.hashes):
                s = job.start - job.start % bs + i * bs
                got = self.store.read(h, job.tokens[s : s + bs])
                if isinstance(got, str):
                    self.misses[got] += 1
                    if got != "missing":
                        with self._lock:
                            self._removed.append(h)
                    break
                kvs.append(got)
        except OSError as e:
            self.turn_off(f"reading {self.store.path}: {e}")
        kv = torch.cat(kvs, dim=1) if kvs else None
        self._done.put(ReadResult(job, len(kvs), kv))
        self._landed.set()

    def turn_off(self, reason: str) -> None:
        if not self.off:
            self.off = True
            log.warning("disk KV tier off, serving from the host tier alone: %s", reason)

    # ------------------------------------------------------------ checks, end
    def flush(self) -> None:
        """Wait for every queued write and read (checks, tests, shutdown)."""
        self._writer.flush()
        self._reader.submit(lambda: None).result()

    def check(self) -> None:
        self.flush()
        self.store.check()

    def close(self) -> None:
        self._writer.close()
        self._reader.shutdown(wait=True)


def run_fills(fills: list[Fill], tensors: list[torch.Tensor]) -> None:
    """Write fills into a host pool's tensors: this rank's heads, the first ``heads`` of a fill's
    (rank 0 holds every rank's; a follower gets its own alone)."""
    for slots, kv in fills:
        scatter_slots(tensors, torch.from_numpy(slots), kv[:, :, : tensors[0].shape[1]])
