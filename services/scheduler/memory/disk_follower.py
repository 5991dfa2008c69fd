"""DiskFollower: a tensor-parallel follower's (rank > 0) side of the disk KV tier
(docs/architecture.md, "KV tiers"; rank 0's side: memory/disk_tier.py).

Rank 0 decides everything (the index, LRU, lookups, which blocks to read and write) and reads and
checks every rank's part of a block itself; a follower only runs each step's ``RankDiskOps``, which
rank 0 sends before the step's plan (tensor_parallel.py): its captures (this rank's heads of the
host pages, gathered before the step's copies rewrite them, written as this rank's part of each
block by a writer thread) and its fills (this rank's heads of blocks rank 0 read). A write the disk
refuses turns this rank's writing off with one warning: rank 0 then finds those blocks' parts
missing, a counted miss each, and the requests compute them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from radixserve.common.atomic_file import write_atomic
from radixserve.scheduler.memory.disk_store import encode_block, part_name
from radixserve.scheduler.memory.disk_tier import Blocks, CaptureWriter, RankDiskOps, run_fills

log = logging.getLogger(__name__)


class DiskFollower:
    def __init__(self, path: str | Path, rank: int, tp: int) -> None:
        self.path, self.rank, self.tp = Path(path), rank, tp
        self.off = False
        self._staged: dict[int, RankDiskOps] = {}  # by sequence number: received, not run yet
        self._root_hash = 0  # the model root of the blocks (rank 0 fixes it before any block; ops carry it)
        self._writer = CaptureWriter(self._write)

    def stage(self, ops: RankDiskOps) -> None:
        """Rank 0's ops for step ``ops.seq`` (they arrive before the step's plan)."""
        self._staged[ops.seq] = ops

    def run_step(self, seq: int, tensors: list[torch.Tensor]) -> None:
        """The step's captures (gathered now, written by the writer thread), then its fills."""
        ops = self._staged.pop(seq)
        self._root_hash = ops.root_hash
        for slots, blocks in ops.captures:
            if self.off:
                break
            self._writer.submit(slots, blocks, tensors)  # dropped: rank 0 finds the parts missing, a miss
        run_fills(ops.fills, tensors)

    def _write(self, blocks: Blocks, kv: torch.Tensor) -> None:
        bs = kv.shape[1] // max(len(blocks), 1)
        try:
            for i, (h, tokens) in enumerate(blocks):
                if self.off:
                    return
                data = encode_block(
                    self._root_hash, h, tokens, kv[:, i * bs : (i + 1) * bs], self.rank, self.tp
                )
                write_atomic(self.path / part_name(h, self.rank, self.tp), data)
        except OSError as e:
            if not self.off:
                self.off = True
                log.warning("disk KV tier: rank %d writes no more parts: %s", self.rank, e)

    def flush(self) -> None:
        """Wait for every queued write (the write-down at a stop)."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
