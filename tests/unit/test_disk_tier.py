"""The disk KV tier (docs/architecture.md, "KV tiers") under the scheduler: blocks the host tier drops
are written to files and read back when a prompt hits them, with the same outputs; a restarted
scheduler, or another one on the same directory, serves them; a bad file is a counted miss and the
request computes those tokens; a disk that cannot hold a block turns the tier off with one warning.

The model-free echo runner (tests/helpers/scheduler.py) checks every request's KV at every step: its
fake host pool is what the disk tier captures and fills, so a block read back into the wrong pages,
or a file served for the wrong tokens, fails there.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve.scheduler.memory.disk_store import BlockLayout, DiskStore
from radixserve.scheduler.memory.disk_tier import DiskTier
from tests.helpers.host_tier import PREFIX, SCHEDULER_CASES, random_kv_pool
from tests.helpers.scheduler import make_req, reference_output, run_to_completion, runner_for, sched

BLOCK = 8  # two pages of 4


def _tier(path: Path, capacity: int = 1 << 20) -> DiskTier:
    layout = BlockLayout((1, BLOCK, 1, 1), torch.int64)  # the echo runner's KV: a token id per slot
    return DiskTier(DiskStore(path, capacity, layout, root_hash=1234), BLOCK)


def _scheduler(disk: DiskTier | None, host: int = 64, **kw):
    return sched(total=160, page=4, host=host, disk=disk, min_new_token_ratio=0.0, **kw)


def _round(s, turn: int, convs: range = range(6), check: bool = True) -> dict[str, int]:
    """One turn of conversations ``convs`` (each its own 48-token prefix); outputs by request."""
    for c in convs:
        prefix = [1000 + 100 * c + i for i in range(PREFIX)]
        s.add(make_req(f"c{c}t{turn}", [*prefix, 7 + turn, 9 + c], max_new=12, t=float(10 * turn + c)))
    out = {}
    for r in run_to_completion(s, check=check):  # the invariant on every tier and every KV, every step
        assert r.output_ids == reference_output(r.origin_ids.tolist(), 12), r.rid
        out[r.rid] = r.num_cached_tokens
    return out


def _done(s) -> None:
    s.kv.check(())
    assert s.kv.available() == s.kv.capacity  # every device page free or evictable after the load
    assert s.kv.host.free_tokens + s.kv.cache.host_size == s.kv.host.capacity_tokens


@SCHEDULER_CASES
def test_disk_tier_serves_what_the_host_tier_dropped_with_the_same_outputs(tmp_path, kw):
    host_only = _scheduler(None, **kw)
    for turn in range(2):
        _round(host_only, turn)
    tier = _tier(tmp_path)
    s = _scheduler(tier, **kw)
    _round(s, 0)
    hits = _round(s, 1)
    _done(s)
    assert tier.written_tokens > 0 and tier.read_tokens > 0 and not tier.misses
    assert sum(hits.values()) >= 4 * PREFIX - 4 * BLOCK  # most second turns hit their prefix
    assert s.prefill_tokens < host_only.prefill_tokens
    tier.close()


def test_a_restarted_scheduler_and_one_sharing_the_directory_serve_its_blocks(tmp_path):
    first = _tier(tmp_path)
    other = _tier(tmp_path)  # opened before anything was written: finds the blocks by a stat
    s = _scheduler(first)
    _round(s, 0)
    first.flush()
    first.close()
    restarted = _tier(tmp_path)
    assert restarted.store.dir_id == first.store.dir_id == other.store.dir_id
    assert len(restarted.store.hashes()) >= 6 * (PREFIX // BLOCK) // 2  # the scan found them
    for tier in (restarted, other):
        s2 = _scheduler(tier, host=128)  # room to read a whole prefix (half the host tier)
        hits = _round(s2, 1, convs=range(3))
        assert min(hits.values()) >= PREFIX - BLOCK, hits  # served from disk on the first requests
        assert tier.read_tokens > 0
        _done(s2)
        tier.close()


@pytest.mark.parametrize("fault", ["corrupt", "truncated", "foreign", "missing"])
def test_a_bad_file_is_a_counted_miss_deleted_and_the_request_computes_it(tmp_path, fault):
    tier = _tier(tmp_path)
    s = _scheduler(tier)
    _round(s, 0)
    tier.flush()
    files = sorted(tmp_path.glob("*.kv"))
    assert files
    bad = {}
    for f in files:
        raw = bytearray(f.read_bytes())
        if fault == "corrupt":
            raw[-3] ^= 0xFF  # a flipped KV byte
        elif fault == "truncated":
            raw = raw[: len(raw) - 5]
        elif fault == "foreign":
            raw[6] ^= 0x01  # another model's root hash
        if fault == "missing":
            f.unlink()  # gone, as another scheduler's eviction would leave it
        else:
            f.write_bytes(bytes(raw))
            bad[f] = bytes(raw)
    s2 = _scheduler(tier)  # a fresh tree: every hit would come from the (bad) files
    # (files deleted behind the index's back fail its check until read: "missing" runs unchecked)
    hits = _round(s2, 1, check=fault != "missing")  # outputs checked: a bad block never served
    assert tier.misses[fault] >= 3 and sum(tier.misses.values()) == tier.misses[fault]
    assert tier.read_tokens == 0 and sum(hits.values()) == 0
    tier.flush()
    if fault != "missing":  # a missing file has nothing left to keep
        kept = [f for f, raw in bad.items() if f.exists() and f.read_bytes() == raw]
        assert len(kept) <= len(bad) - tier.misses[fault], "a bad file read was kept"  # unread ones stay
        _done(s2)
    tier.close()


def test_a_disk_that_cannot_hold_a_block_turns_the_tier_off_with_one_warning(tmp_path, caplog):
    tier = _tier(tmp_path, capacity=64)  # smaller than one block's file
    s = _scheduler(tier)
    with caplog.at_level(logging.WARNING):
        for turn in range(2):
            _round(s, turn)
        tier.flush()
    warned = [r for r in caplog.records if "disk KV tier off" in r.getMessage()]
    assert tier.off and len(warned) == 1
    assert not list(tmp_path.glob("*.kv"))
    _done(s)
    tier.close()


def test_a_request_waits_for_its_disk_read_while_the_others_run(tmp_path):
    import threading

    tier = _tier(tmp_path)
    s = _scheduler(tier)
    _round(s, 0)  # the first conversations' prefixes go to disk
    tier.flush()
    s2 = _scheduler(tier, host=128)
    held = threading.Event()
    tier._reader.submit(held.wait)  # the reader is busy: the read below stays in flight
    on_disk = make_req("disk", [*[1000 + i for i in range(PREFIX)], 8, 9], max_new=4)
    fresh = make_req("fresh", [1, 2, 3, 4, 5, 6], max_new=4)
    s2.add(on_disk)
    s2.add(fresh)
    batch = s2.schedule()
    assert batch is not None and [r.rid for r in batch.reqs] == ["fresh"]  # it did not wait
    assert tier.reading and on_disk in s2.waiting
    done = s2.process(batch, runner_for(s2).forward(batch))
    held.set()
    tier.flush()
    done += run_to_completion(s2)
    assert {r.rid for r in done} == {"disk", "fresh"}
    assert on_disk.num_cached_tokens >= PREFIX - BLOCK  # loaded from disk, not computed
    assert on_disk.output_ids == reference_output(on_disk.origin_ids.tolist(), 4)
    _done(s2)
    tier.close()


def test_the_metrics_report_the_disk_tier(tmp_path):
    from types import SimpleNamespace

    from radixserve.scheduler.metrics import _EngineCollector, _Families

    tier = _tier(tmp_path)
    s = _scheduler(tier)
    _round(s, 0)
    tier.flush()
    for f in tmp_path.glob("*.kv"):
        f.write_bytes(b"RSKV")  # truncated
    s2 = _scheduler(tier)
    _round(s2, 1)
    families = _Families("m")
    _EngineCollector(SimpleNamespace(worker=SimpleNamespace(scheduler=s2)), "m")._disk(families)
    values = {m.name: {sm.labels.get("cause"): sm.value for sm in m.samples} for m in families.out}
    assert values["radixserve_kv_disk_used_bytes"][None] == tier.store.used_bytes > 0
    assert values["radixserve_kv_disk_written_tokens"][None] == tier.written_tokens > 0
    assert values["radixserve_kv_disk_off"][None] == 0
    assert values["radixserve_kv_disk_dropped_writes"][None] == tier.dropped_writes
    misses = values["radixserve_kv_disk_misses"]
    assert misses["truncated"] == tier.misses["truncated"] >= 1
    assert misses["corrupt"] == misses["foreign"] == misses["missing"] == 0
    tier.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_device_to_host_to_disk_to_host_to_device_byte_exact(tmp_path, dtype):
    import numpy as np

    from radixserve.scheduler.memory.allocator import PagedAllocator
    from radixserve.scheduler.memory.disk_tier import ReadJob, StepOps
    from radixserve.scheduler.memory.host_pool import HostKVPool
    from radixserve.scheduler.memory.tiered_cache import KVTransfers

    page, layers, heads, dim = 4, 3, 2, 8
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = random_kv_pool(17 * page, layers, heads, dim, dtype, device)
    before = [t.clone() for t in (*pool.k, *pool.v)]
    layout = BlockLayout((2 * layers, BLOCK, heads, dim), dtype)
    tier = DiskTier(DiskStore(tmp_path, 1 << 20, layout, root_hash=5), BLOCK)
    host = HostKVPool(9 * page, layers, heads, dim, dtype, torch.device(device))
    host.disk = tier
    e = np.zeros(0, dtype=np.int64)

    def slots(n: int, pages: list[int]) -> np.ndarray:
        return PagedAllocator(n, page).pages_to_slots(np.array(pages, dtype=np.int64))

    src, on_host, tokens = slots(16, [3, 7, 8, 15]), slots(8, [6, 1, 2, 5]), np.arange(16, dtype=np.int32)
    host.run(pool, KVTransfers(src, on_host, e, e))  # device -> host (a write-back) ...
    blocks = [(0xA, tokens[:BLOCK]), (0xB, tokens[BLOCK:])]
    seq = tier.seal(StepOps(captures=[(on_host, blocks)]))
    host.run(pool, KVTransfers(e, e, e, e, np.array([seq])))  # ... host -> disk (the next step) ...
    tier.flush()
    for t in host.tensors:
        t.zero_()
    tier.submit_read(ReadJob(tokens, 0, [0xA, 0xB]))  # ... disk -> host ...
    tier.flush()
    (res,) = tier.take_done()
    assert res.blocks == 2 and res.kv is not None
    back_host, back = slots(8, [3, 4, 7, 8]), slots(16, [1, 2, 10, 11])
    seq = tier.seal(StepOps(fills=[(back_host, res.kv)]))
    host.run(pool, KVTransfers(e, e, back_host, back, np.array([seq])))  # ... host -> device, one step
    host.synchronize()
    for got, want in zip((*pool.k, *pool.v), before, strict=True):
        assert torch.equal(got[torch.as_tensor(back, device=device)].cpu().view(torch.uint8),
                           want[torch.as_tensor(src, device=device)].cpu().view(torch.uint8))  # fmt: skip
    tier.close()


def test_block_events_name_the_disk_tier_and_stay_off_until_enabled(tmp_path):
    tier = _tier(tmp_path)
    quiet = _scheduler(tier)
    _round(quiet, 0)
    assert quiet.kv.cache.take_block_events() == []  # hashed for the disk, but no events asked for
    with pytest.raises(ValueError, match="--block-size 6: the disk tier needs a multiple of page_size 4"):
        _scheduler(_tier(tmp_path)).kv.cache.enable_block_events(6, 1234)
    s = _scheduler(_tier(tmp_path / "events"))
    s.kv.cache.enable_block_events(BLOCK, 1234)
    _round(s, 0)
    s.kv.cache.disk.flush()
    kinds = {kind for kind, hashes in s.kv.cache.take_block_events() if hashes}
    assert {"stored", "stored_disk"} <= kinds
    s2 = _scheduler(s.kv.cache.disk)
    s2.kv.cache.enable_block_events(BLOCK, 1234)
    _round(s2, 1)
    kinds = {kind for kind, hashes in s2.kv.cache.take_block_events() if hashes}
    assert "stored_host" in kinds  # blocks read back from disk into the host tier


def test_a_restart_announces_the_directory_s_blocks_under_the_directory_s_location(tmp_path):
    """The prefix index learns a restarted pod's disk blocks from its first snapshot (before any
    request), under the directory's id: every pod mounting the directory can load them."""
    s = _scheduler(_tier(tmp_path))
    s.kv.cache.enable_block_events(BLOCK, 1234)
    _round(s, 0)
    s.kv.cache.disk.flush()
    on_disk = set(s.kv.cache.disk.store.hashes())
    assert on_disk and s.kv.cache.disk_location == s.kv.cache.disk.store.dir_id != ""
    snapshot = dict(s.kv.cache.block_snapshot())
    held = {h for kind, hashes in snapshot.items() if kind != "stored_disk" for h in hashes}
    assert set(snapshot.get("stored_disk", [])) == on_disk - held  # disk-only blocks, once each
    restarted = _scheduler(_tier(tmp_path))  # a new process on the same directory: an empty tree
    restarted.kv.cache.enable_block_events(BLOCK, 1234)
    assert dict(restarted.kv.cache.block_snapshot()) == {
        "stored_disk": list(restarted.kv.cache.disk.store.hashes())
    }
    assert set(restarted.kv.cache.disk.store.hashes()) == on_disk
    assert restarted.kv.cache.disk_location == s.kv.cache.disk_location


def test_an_idle_step_sleeps_until_the_disk_read_lands_instead_of_spinning(tmp_path):
    """``await_read`` (what a step that found nothing to run calls) blocks while a read is in flight
    and returns when it lands; with none in flight it returns at once."""
    import threading

    tier = _tier(tmp_path)
    s = _scheduler(tier)
    _round(s, 0)
    tier.flush()
    waiter = threading.Thread(target=tier.await_read, args=(60.0,))
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive()  # nothing in flight: no wait
    s2 = _scheduler(tier, host=128)
    held = threading.Event()
    tier._reader.submit(held.wait)  # the reader is busy: the read stays in flight
    s2.add(make_req("disk", [*[1000 + i for i in range(PREFIX)], 8, 9], max_new=4))
    assert s2.schedule() is None and tier.reading  # every waiting request waits on its read
    waiter = threading.Thread(target=s2.kv.await_disk_read, args=(60.0,))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # asleep while the read is in flight
    held.set()
    waiter.join(30)
    assert not waiter.is_alive()  # woken by the read landing, long before its 60 s
    run_to_completion(s2)
    _done(s2)
    tier.close()


def test_two_ranks_host_pools_round_trip_through_their_parts_byte_exact(tmp_path):
    """Tensor parallelism without processes: rank 0's DiskTier and rank 1's DiskFollower each capture
    their own heads' host pages into their own part files; rank 0 reads every part back, and each
    rank's fill (rank 1's via ``follower_ops``, as tensor_parallel.py sends it) restores its heads."""
    import numpy as np

    from radixserve.scheduler.memory.disk_follower import DiskFollower
    from radixserve.scheduler.memory.disk_tier import ReadJob, StepOps

    layout = BlockLayout((4, BLOCK, 2, 3), torch.bfloat16)  # 2 layers' K and V, 2 heads per rank
    tier = DiskTier(DiskStore(tmp_path, 1 << 20, layout, root_hash=1234, tp=2), BLOCK)
    follower = DiskFollower(tmp_path, rank=1, tp=2)
    gen = torch.Generator().manual_seed(0)
    pools = [[torch.randn((32, 2, 3), generator=gen).to(torch.bfloat16) for _ in range(4)] for _ in range(2)]
    before = [[t.clone() for t in p] for p in pools]
    tokens, on_host = np.arange(2 * BLOCK, dtype=np.int32), np.arange(4, 4 + 2 * BLOCK, dtype=np.int64)
    seq = tier.seal(StepOps(captures=[(on_host, [(0xA, tokens[:BLOCK]), (0xB, tokens[BLOCK:])])]))
    (ops,) = tier.follower_ops(seq)
    follower.stage(ops)
    tier.run_step(seq, pools[0])
    follower.run_step(seq, pools[1])
    tier.flush()
    follower.flush()
    assert sorted(p.name[17:] for p in tmp_path.glob("*.kv")) == [
        "r0of2.kv",
        "r0of2.kv",
        "r1of2.kv",
        "r1of2.kv",
    ]
    for p in pools:
        for t in p:
            t.zero_()
    tier.submit_read(ReadJob(tokens, 0, [0xA, 0xB]))
    tier.flush()
    (res,) = tier.take_done()
    assert res.blocks == 2 and res.kv is not None and res.kv.shape == (4, 2 * BLOCK, 4, 3)
    back = np.arange(16, 16 + 2 * BLOCK, dtype=np.int64)
    seq = tier.seal(StepOps(fills=[(back, res.kv)]))
    (ops,) = tier.follower_ops(seq)
    assert ops.fills[0][1].shape == (4, 2 * BLOCK, 2, 3)  # rank 1's heads alone cross the pipe
    follower.stage(ops)
    tier.run_step(seq, pools[0])
    follower.run_step(seq, pools[1])
    for rank in (0, 1):
        for got, want in zip(pools[rank], before[rank], strict=True):
            assert torch.equal(got[back].view(torch.uint8), want[on_host].view(torch.uint8)), rank
    assert not tier.misses
    tier.close()
    follower.close()


def test_a_capture_over_the_writers_backlog_is_dropped_before_it_is_copied(monkeypatch):
    """A disk slower than eviction: the capture is refused by its size, no copy of its pages made."""
    from radixserve.scheduler.memory import disk_tier

    tensors = [torch.arange(64.0).reshape(16, 2, 2) for _ in range(4)]  # 4 x 16 slots of 4 floats
    one = 4 * 4 * 4 * 4  # 4 slots of every tensor, in bytes
    monkeypatch.setattr(disk_tier, "MAX_PENDING_WRITE_BYTES", one)
    release, written = threading.Event(), []

    def write(blocks, kv):
        release.wait(10)
        written.append(kv.clone())

    copies = []
    real = disk_tier.gather_slots
    monkeypatch.setattr(disk_tier, "gather_slots", lambda *a: copies.append(1) or real(*a))
    writer = disk_tier.CaptureWriter(write)
    slots = np.arange(4, dtype=np.int64)
    assert writer.submit(slots, [(1, np.zeros(4, dtype=np.int32))], tensors)
    assert not writer.submit(slots + 4, [(2, np.zeros(4, dtype=np.int32))], tensors)  # over the backlog
    assert len(copies) == 1  # the dropped capture was never gathered
    release.set()
    writer.flush()
    assert len(written) == 1 and torch.equal(written[0][0], tensors[0][:4])
    assert writer.submit(slots + 4, [(2, np.zeros(4, dtype=np.int32))], tensors)  # room again
    writer.close()
