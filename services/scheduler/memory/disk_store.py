"""DiskStore: the disk KV tier's files of blocks (docs/architecture.md, "KV tiers").

One file per block of KV, named by the block's chained hash (``common/block_hash.py``), so any
scheduler on the same directory (a restarted one, or another pod on a shared volume) finds a block
from its prompt alone. With tensor parallelism (``tp`` > 1) a block is one file per rank, each of
that rank's KV heads (``{hash}.r{rank}of{tp}.kv``; ``{hash}.kv`` without): every rank writes its
own part (memory/disk_follower.py on ranks > 0), this store (rank 0's) keeps the index of whole
blocks, their bytes over every part, and reads and checks every part. A file is a fixed header, the
block's token ids, then its KV bytes::

    magic b"RSKV" | format version u16 | root hash u64 | block hash u64 | tokens u32 | KV bytes u64
    | crc32 u32 (of the token ids and the KV bytes) | rank u16 | tp u16 | token ids (int32 each)
    | KV bytes

A read checks all of it: a file of another format, model (the root hash) or layout (its rank and tp
size), or of other tokens, is ``foreign``; a short one ``truncated``; a checksum that does not match
``corrupt``; a file gone ``missing``. A bad file (any rank's part) is deleted with its block's other
parts, never served. Writes are atomic (``common/atomic_file.py``: a temp file, then a rename): a reader
sees a whole file or none. The index (hash -> file bytes, least recently used first) is built by a
scan at start and kept by this store's writes and reads; a lookup that misses it stats the files (at
most once a second per block), so another scheduler's writes are found. Within ``capacity_bytes``
the least recently used files go first. ``DIR_ID`` holds a random id made once per directory (the
first scheduler to start creates it atomically): the directory's identity as a location that every
scheduler mounting it can load from.

Thread-safe: the scheduler thread looks up, a reader thread reads, a writer thread writes.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from radixserve.common.atomic_file import TEMP_PREFIX, write_atomic

FORMAT_VERSION = 2  # 2: the rank and tp size
MAGIC = b"RSKV"
_HEADER = struct.Struct("<4sHQQIQIHH")
MISS_CAUSES = ("corrupt", "foreign", "truncated", "missing")
# A temp file this old at start is a crashed writer's (a block's write takes milliseconds; a younger
# one may be another scheduler's, writing now into the shared directory): deleted.
STALE_TEMP_S = 3600.0
_STAT_EVERY_S = 1.0  # a block absent from the index is looked for on disk at most this often
# A follower's part may land after rank 0's (each rank's writer runs on its own): a read waits this
# long for it before the block is a miss (a part that never lands costs one read this, once).
_PART_WAIT_S = 0.5


def part_name(block_hash: int, rank: int, tp: int) -> str:
    """The file of rank ``rank``'s part of a block (the whole block without tensor parallelism)."""
    return f"{block_hash:016x}.kv" if tp == 1 else f"{block_hash:016x}.r{rank}of{tp}.kv"


def name_pattern(tp: int) -> re.Pattern[str]:
    """The names of the parts a ``tp``-rank layout writes (group 1: the block's hash)."""
    return re.compile(r"^([0-9a-f]{16})\.kv$" if tp == 1 else rf"^([0-9a-f]{{16}})\.r\d+of{tp}\.kv$")


def encode_block(
    root_hash: int, block_hash: int, tokens: npt.NDArray[np.integer], kv: torch.Tensor, rank: int, tp: int
) -> list[bytes | memoryview]:
    """A file's bytes, in the parts to write one after the other: the header and the token ids, then
    ``kv`` (rank ``rank``'s heads of the block): a view of it made contiguous, its one copy (a block
    cut from a capture, ``[2L, n, heads, dim]``, is strided)."""
    ids = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    data = kv.contiguous().view(torch.uint8).numpy().data.cast("B")
    crc = zlib.crc32(data, zlib.crc32(ids))
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, root_hash, block_hash, len(tokens), len(data), crc, rank, tp)
    return [head + ids, data]


class DiskFullError(OSError):
    """A block cannot fit within the store's size bound (the bound is smaller than one file)."""


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The KV of one block: ``[2 * layers, block_size, kv_heads, head_dim]`` of ``dtype``."""

    shape: tuple[int, int, int, int]
    dtype: torch.dtype

    @property
    def kv_bytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def file_bytes(self) -> int:
        return _HEADER.size + 4 * self.shape[1] + self.kv_bytes


class DiskStore:
    def __init__(
        self, path: str | Path, capacity_bytes: int, layout: BlockLayout, root_hash: int, tp: int = 1
    ) -> None:
        """Opens (creating it if needed) the directory ``path`` and indexes the blocks it holds.
        ``layout``: one rank's part (``tp`` ranks: each holds its own KV heads; ``capacity_bytes``
        bounds every part together). Raises OSError when the directory cannot be created or written."""
        self.path = Path(path)
        self.tp = tp
        self._name = name_pattern(tp)
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.root_hash = root_hash  # the model's: a file with another is foreign
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recent first
        self._absent: dict[int, float] = {}  # hash -> when a lookup last found no file
        self.used_bytes = 0
        self.path.mkdir(parents=True, exist_ok=True)
        self.dir_id = self._dir_id()
        self._scan()

    # ------------------------------------------------------------ the directory
    def _dir_id(self) -> str:
        marker = self.path / "DIR_ID"
        if not marker.exists():
            tmp = self.path / f".tmp-{uuid.uuid4().hex}"
            tmp.write_text(uuid.uuid4().hex)
            try:
                os.link(tmp, marker)  # atomic, and never replaces another scheduler's id
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return marker.read_text().strip()

    def _scan(self) -> None:
        found: dict[int, tuple[float, int]] = {}  # hash -> newest part's mtime, bytes of its parts
        now = time.time()
        for entry in os.scandir(self.path):
            if entry.name.startswith(TEMP_PREFIX) and now - entry.stat().st_mtime > STALE_TEMP_S:
                with contextlib.suppress(OSError):  # a crashed writer's; another scheduler may race us
                    os.unlink(entry.path)
            elif self._name.match(entry.name):
                st, h = entry.stat(), int(entry.name[:16], 16)
                mtime, size = found.get(h, (0.0, 0))
                found[h] = (max(mtime, st.st_mtime), size + st.st_size)
        # oldest first: the LRU order survives a restart (mtime). A block missing a part (a rank's
        # write that never landed) is indexed too: its bytes count, and its first read drops it.
        for h, (_, size) in sorted(found.items(), key=lambda kv: kv[1][0]):
            self._index[h] = size
            self.used_bytes += size

    def file(self, block_hash: int, rank: int = 0) -> Path:
        return self.path / part_name(block_hash, rank, self.tp)

    def files(self, block_hash: int) -> list[Path]:
        """Every rank's part of the block."""
        return [self.file(block_hash, r) for r in range(self.tp)]

    # ----------------------------------------------------------------- lookup
    def has(self, block_hash: int) -> bool:
        with self._lock:
            if block_hash in self._index:
                return True
            seen = self._absent.get(block_hash)
            now = time.monotonic()
            if seen is not None and now - seen < _STAT_EVERY_S:
                return False
            self._absent[block_hash] = now
            if len(self._absent) > 65536:
                self._absent.clear()
        try:  # another scheduler's write: found once every rank's part is
            size = sum(f.stat().st_size for f in self.files(block_hash))
        except OSError:
            return False
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = size
                self.used_bytes += size
            self._absent.pop(block_hash, None)
        return True

    def indexed(self, block_hash: int) -> bool:
        """In the index (no stat): a block this store wrote, read or found."""
        with self._lock:
            return block_hash in self._index

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._index)

    # ------------------------------------------------------------------ write
    def write(self, block_hash: int, tokens: npt.NDArray[np.integer], kv: torch.Tensor) -> list[int] | None:
        """Store one block (rank 0's part: the other ranks write theirs, memory/disk_follower.py);
        returns the hashes of the blocks evicted to make room (None: it was there). Raises
        DiskFullError when one block exceeds the bound, OSError when the disk refuses."""
        data = encode_block(self.root_hash, block_hash, tokens, kv, 0, self.tp)
        size = sum(len(part) for part in data) * self.tp  # every rank's part: the same heads, the same size
        if size > self.capacity_bytes:
            raise DiskFullError(f"one block ({size} bytes) exceeds the disk tier's bound")
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return None
            evicted = self._evict_to(self.capacity_bytes - size)
        for h in evicted:  # off the index already: deleted outside the lock (the scheduler's lookups take it)
            for f in self.files(h):
                f.unlink(missing_ok=True)
        write_atomic(self.file(block_hash), data)
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = size
                self.used_bytes += size
        return evicted

    def _evict_to(self, limit: int) -> list[int]:
        """Take least recently used blocks off the index until at most ``limit`` bytes are used (under
        the lock); the caller deletes their files."""
        evicted = []
        while self.used_bytes > limit and self._index:
            h, size = self._index.popitem(last=False)
            self.used_bytes -= size
            evicted.append(h)
        return evicted

    # ------------------------------------------------------------------- read
    def read(self, block_hash: int, tokens: npt.NDArray[np.integer]) -> torch.Tensor | str:
        """The block's KV (``layout``; with ``tp`` ranks every rank's part, concatenated along the
        heads: rank r's are ``[:, :, r * heads : (r + 1) * heads]``), or why not (a MISS_CAUSES
        entry; the block's files are then deleted: a part that fails is a miss of the whole block)."""
        parts = []
        for rank, path in enumerate(self.files(block_hash)):
            raw = _read_file(path, _PART_WAIT_S if rank else 0.0, self.layout.kv_bytes)
            if raw is None:  # rank 0's: gone (evicted by another scheduler); another rank's: a write
                self._drop(block_hash, delete=rank > 0)  # that never landed (its writer off, behind)
                return "missing"
            cause = self._verify(*raw, block_hash, tokens, rank)
            if cause is not None:
                self._drop(block_hash, delete=True)
                return cause
            parts.append(raw[1].view(self.layout.dtype).reshape(self.layout.shape))
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        for path in self.files(block_hash):
            with contextlib.suppress(OSError):
                os.utime(path)  # the LRU order after a restart
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _verify(
        self, head: bytearray, kv: torch.Tensor, block_hash: int, tokens: npt.NDArray[np.integer], rank: int
    ) -> str | None:
        """Why the file ``head`` + ``kv`` (``_read_file``'s) is not this block's part (None: it is)."""
        size = len(head) + len(kv)
        if size < _HEADER.size:
            return "truncated"
        magic, version, root, h, n, nbytes, crc, its_rank, its_tp = _HEADER.unpack_from(head)
        if magic != MAGIC:
            return "corrupt"
        if version != FORMAT_VERSION or root != self.root_hash or nbytes != self.layout.kv_bytes:
            return "foreign"
        if (its_rank, its_tp) != (rank, self.tp):
            return "foreign"  # another tensor-parallel layout's part
        if h != block_hash or n != len(tokens):
            return "corrupt"  # its name and its header disagree
        end = _HEADER.size + 4 * n + nbytes
        if size < end:
            return "truncated"
        # size == end from here: ``_read_file`` split the file at its KV, ``head`` is the header and ids
        ids = memoryview(head)[_HEADER.size :]
        if size > end or zlib.crc32(kv.numpy().data, zlib.crc32(ids)) != crc:
            return "corrupt"
        if ids != np.ascontiguousarray(tokens, dtype="<i4").tobytes():
            return "foreign"  # the same hash for other tokens: never served
        return None

    def _drop(self, block_hash: int, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size
        if delete:
            for f in self.files(block_hash):
                f.unlink(missing_ok=True)

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """Every indexed block is a file, their bytes (as written) within the bound. Files another
        scheduler sharing the directory wrote may not be indexed yet (none may delete one meanwhile)."""
        with self._lock:
            on_disk = {int(e.name[:16], 16) for e in os.scandir(self.path) if self._name.match(e.name)}
            stale = set(self._index) - on_disk
            assert not stale, f"indexed blocks with no file: {sorted(stale)[:4]}"
            assert self.used_bytes == sum(self._index.values()) <= self.capacity_bytes, (
                self.used_bytes,
                self.capacity_bytes,
            )


def _read_file(path: Path, wait_s: float, kv_bytes: int) -> tuple[bytearray, torch.Tensor] | None:
    """The file's bytes, read once: all but the last ``kv_bytes`` (a good file's header and token
    ids), then those into a tensor of their own (its KV, aligned for any dtype); all in the first
    part when the file is too short to hold a header and KV. None when it does not exist within
    ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                kv = torch.empty(kv_bytes if size >= _HEADER.size + kv_bytes else 0, dtype=torch.uint8)
                head = bytearray(size - len(kv))
                if f.readinto(head) + f.readinto(kv.numpy().data) < size:
                    return bytearray(), torch.empty(0, dtype=torch.uint8)  # cut short as it was read
                return head, kv
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
