"""The disk KV tier's files (memory/disk_store.py): a block reads back byte-exact, a bad file is a miss
by cause and deleted, the least recently used files go first within the bound, and a directory keeps
its id and its blocks across stores (a restart, or another scheduler sharing it)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from radixserve.common.atomic_file import write_atomic
from radixserve.scheduler.memory.disk_store import (
    STALE_TEMP_S,
    BlockLayout,
    DiskFullError,
    DiskStore,
    encode_block,
)

LAYOUT = BlockLayout((6, 4, 2, 8), torch.bfloat16)  # 3 layers' K and V, 4 tokens, 2 heads of 8


def _kv(seed: int, layout: BlockLayout = LAYOUT) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=gen).to(layout.dtype)


def _tokens(seed: int) -> np.ndarray:
    return np.arange(seed, seed + 4, dtype=np.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_reads_back_byte_exact(tmp_path, dtype):
    layout = BlockLayout(LAYOUT.shape, dtype)
    store = DiskStore(tmp_path, 1 << 20, layout, root_hash=7)
    kv = _kv(1, layout)
    assert store.write(0xABC, _tokens(5), kv) == []
    assert store.write(0xABC, _tokens(5), kv) is None  # there already
    got = store.read(0xABC, _tokens(5))
    assert isinstance(got, torch.Tensor) and got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    assert (tmp_path / "0000000000000abc.kv").stat().st_size == layout.file_bytes
    store.check()


def test_a_file_for_other_tokens_or_another_model_is_a_foreign_miss_and_deleted(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7)
    store.write(1, _tokens(5), _kv(1))
    assert store.read(1, _tokens(6)) == "foreign"  # the same name for other tokens: never served
    assert not store.has(1) and not store.file(1).exists()
    store.write(2, _tokens(5), _kv(1))
    other_model = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=8)
    assert other_model.has(2) and other_model.read(2, _tokens(5)) == "foreign"
    assert other_model.read(2, _tokens(5)) == "missing"
    store.write(3, _tokens(5), _kv(1))
    wider = DiskStore(tmp_path, 1 << 20, BlockLayout((6, 4, 4, 8), torch.bfloat16), root_hash=7)
    assert wider.read(3, _tokens(5)) == "foreign"  # a row width of another shape: never loaded


def test_the_least_recently_used_files_go_first_within_the_bound(tmp_path):
    store = DiskStore(tmp_path, 3 * LAYOUT.file_bytes, LAYOUT, root_hash=7)
    for h in (1, 2, 3):
        assert store.write(h, _tokens(h), _kv(h)) == []
    assert isinstance(store.read(1, _tokens(1)), torch.Tensor)  # 1 is now the most recent
    assert store.write(4, _tokens(4), _kv(4)) == [2]
    assert store.write(5, _tokens(5), _kv(5)) == [3]
    assert sorted(store.hashes()) == [1, 4, 5] and store.used_bytes == 3 * LAYOUT.file_bytes
    assert sorted(int(p.stem, 16) for p in tmp_path.glob("*.kv")) == [1, 4, 5]
    store.check()
    with pytest.raises(DiskFullError):  # a bound smaller than one file can never hold a block
        DiskStore(tmp_path, LAYOUT.file_bytes - 1, LAYOUT, root_hash=7).write(9, _tokens(9), _kv(9))


def test_a_directory_keeps_its_id_and_blocks_for_the_next_store_and_a_sharing_one(tmp_path):
    first = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7)
    sharing = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7)
    first.write(11, _tokens(11), _kv(11))
    restarted = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7)
    assert first.dir_id == sharing.dir_id == restarted.dir_id and len(first.dir_id) == 32
    assert restarted.hashes() == [11]  # the scan at start
    assert sharing.has(11)  # not in its index: found by a stat
    got = sharing.read(11, _tokens(11))
    assert isinstance(got, torch.Tensor) and torch.equal(got.view(torch.uint8), _kv(11).view(torch.uint8))
    assert not list(tmp_path.glob(".tmp-*"))  # the atomic writes left no temp file
    restarted.check()


def test_a_crashed_writers_old_temp_file_is_swept_at_start_and_a_fresh_one_kept(tmp_path):
    """A writer killed between its temp file and the rename leaves the temp file: the next store
    deletes it once it is old (a fresh one may be a sharing scheduler's write in progress)."""
    DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7).write(11, _tokens(11), _kv(11))
    old, fresh = tmp_path / ".tmp-crashed", tmp_path / ".tmp-writing"
    old.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y")
    long_ago = time.time() - STALE_TEMP_S - 60
    os.utime(old, (long_ago, long_ago))
    restarted = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7)
    assert not old.exists() and fresh.exists()
    assert restarted.hashes() == [11] and restarted.used_bytes == LAYOUT.file_bytes


# ----------------------------------------------------------- tensor parallelism: a part per rank
def _part(store: DiskStore, h: int, rank: int, kv: torch.Tensor) -> None:
    """Rank ``rank``'s part of block ``h``, as a follower writes it (memory/disk_follower.py)."""
    write_atomic(store.file(h, rank), encode_block(store.root_hash, h, _tokens(5), kv, rank, store.tp))


def test_with_tp_every_rank_has_its_part_and_a_read_checks_them_all(tmp_path):
    """Rank 0 writes its part and accounts for every rank's; a read returns every rank's heads, and
    a bad part on any rank is a miss of the whole block, whose parts are all deleted."""
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7, tp=2)
    k0, k1 = _kv(1), _kv(2)
    assert store.write(9, _tokens(5), k0) == [] and store.used_bytes == 2 * LAYOUT.file_bytes
    assert store.read(9, _tokens(5)) == "missing"  # rank 1's part never landed: deleted, unindexed
    assert not list(tmp_path.glob("*.kv")) and not store.has(9)
    store.write(9, _tokens(5), k0)
    _part(store, 9, 1, k1)
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == [
        "0000000000000009.r0of2.kv",
        "0000000000000009.r1of2.kv",
    ]
    got = store.read(9, _tokens(5))
    assert isinstance(got, torch.Tensor) and torch.equal(got, torch.cat([k0, k1], dim=2))
    again = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7, tp=2)  # a restart: the scan
    assert again.hashes() == [9] and again.used_bytes == 2 * LAYOUT.file_bytes
    raw = bytearray(store.file(9, 1).read_bytes())
    raw[-3] ^= 0x5A
    store.file(9, 1).write_bytes(bytes(raw))
    assert again.read(9, _tokens(5)) == "corrupt" and not list(tmp_path.glob("*.kv"))
    again.check()


def test_a_part_of_another_tp_layout_is_foreign_and_another_layout_sees_no_blocks(tmp_path):
    one = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7)
    two = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7, tp=2)
    one.write(5, _tokens(5), _kv(1))
    two.write(6, _tokens(5), _kv(1))
    _part(two, 6, 1, _kv(2))
    assert not two.has(5) and not one.has(6)  # names of another layout: not its blocks
    assert DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7, tp=2).hashes() == [6]
    assert DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7).hashes() == [5]
    for rank in (0, 1):  # tp 1's file under tp 2's names: its header says so
        two.file(5, rank).write_bytes(one.file(5).read_bytes())
    fresh = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7, tp=2)  # its scan finds them
    assert fresh.has(5) and fresh.read(5, _tokens(5)) == "foreign"
    swapped = DiskStore(tmp_path, 1 << 20, LAYOUT, root_hash=7, tp=2)
    _part(swapped, 7, 1, _kv(1))
    swapped.file(7, 0).write_bytes(swapped.file(7, 1).read_bytes())  # rank 1's part as rank 0's
    assert swapped.has(7) and swapped.read(7, _tokens(5)) == "foreign"
