"""The gateway's in-memory prefix index at its boundary: what a scheduler's Watch stream may carry
that it should not (blocks the pod never announced, hashes out of range, a pod name no key could
hold, another model's blocks), each dropped or refused and logged, never raising into the stream
nor touching another pod's entries. Parity with the Redis backend (test_prefix_index_boundary.py
runs the bad-input cases shared by both); SchedulerPool against a fake scheduler's Watch stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.common.kv_tier import DEVICE, DISK, HOST, TierMatch
from radixserve.common.prefix_index import InMemoryPrefixIndex
from radixserve.common.rpc import pb, pb_grpc
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle, SchedulerPool
from tests.helpers.prefix_index import BS, MODEL, hashes_of, prompt

LOGGER = "radixserve.common.prefix_index"
POOL = "radixserve.tokenizer.routing.scheduler_pool"


# -------------------------------------------------------------------------- InMemoryPrefixIndex
def test_removed_blocks_the_pod_never_announced_touch_no_entry_and_make_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    idx = InMemoryPrefixIndex()
    h = hashes_of(prompt(1, 4))
    idx.apply("a:1", h, [])
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        idx.apply("b:1", [], h)  # b never held them
        idx.apply("stranger:1", [], [*h, 12345])  # a pod the index never saw
        idx.apply("a:1", [], [999, 1000])  # a's own, never stored
    assert idx.match(h) == {"a:1": 4} and idx.num_blocks("a:1") == 4
    assert idx.num_blocks("b:1") == 0 and idx.num_blocks("stranger:1") == 0
    assert idx.sweep() == ["a:1"]  # no heartbeat: only the pod that holds blocks had an entry
    unheld = [r.getMessage() for r in caplog.records if "were not in the index" in r.getMessage()]
    assert unheld == [
        "prefix index: 4 removed block(s) of b:1 were not in the index",
        "prefix index: 5 removed block(s) of stranger:1 were not in the index",
        "prefix index: 2 removed block(s) of a:1 were not in the index",
    ]
    assert all(r.levelno == logging.DEBUG for r in caplog.records)  # routine, as with Redis


def test_a_removed_list_with_bad_hashes_still_removes_the_good_ones(caplog: pytest.LogCaptureFixture) -> None:
    idx = InMemoryPrefixIndex()
    h = hashes_of(prompt(1, 3))
    idx.apply("a", h, [])
    idx.apply("b", h, [])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        idx.apply("a", [], [-1, h[2], 1 << 64, "x", None])  # type: ignore[list-item]
    assert idx.match(h) == {"a": 2, "b": 3} and idx.num_blocks("a") == 2
    assert len(caplog.records) == 1
    assert "4 removed block hash(es) of a ignored" in caplog.records[0].getMessage()


def test_a_pod_name_no_redis_key_could_hold_is_refused_as_redis_refuses_it() -> None:
    idx = InMemoryPrefixIndex()
    h = hashes_of(prompt(1, 2))
    for bad in ["", "a b", "a\nb", "x" * 257, None, 5]:
        with pytest.raises(ValueError, match="pod name"):
            idx.apply(bad, h, [])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="pod name"):
            idx.heartbeat(bad, {}, 5)  # type: ignore[arg-type]
    assert idx.match(h) == {} and idx.live_pods() == {} and idx.sweep() == []


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf")])
def test_a_heartbeat_ttl_that_is_not_a_positive_number_is_refused(ttl: float, clock: Any) -> None:
    idx = InMemoryPrefixIndex(clock=clock)
    assert idx.heartbeat("a", {"waiting": 1}, 5) is False
    with pytest.raises(ValueError, match="ttl_s"):
        idx.heartbeat("a", {"waiting": 2}, ttl)
    assert idx.live_pods() == {"a": {"waiting": 1}}  # the last good heartbeat stands
    clock.t += 6
    assert idx.live_pods() == {}  # an inf TTL would have made it immortal


def test_blocks_of_a_pod_nobody_heartbeats_for_are_swept_never_matched_after() -> None:
    """A stored list for a pod the gateway does not know (no heartbeat): the next sweep drops it."""
    idx = InMemoryPrefixIndex()
    h = hashes_of(prompt(1, 3))
    idx.heartbeat("known", {}, 60)
    idx.apply("known", h[:1], [])
    idx.apply("unknown", h, [])
    assert idx.sweep() == ["unknown"]
    assert idx.match(h) == {"known": 1} and idx.num_blocks("unknown") == 0


# A hash drawn from a few valid ones and some that are not hashes at all.
VALID = hashes_of(prompt(3, 6))
HASHES = st.one_of(st.sampled_from(VALID), st.sampled_from([-1, 1 << 64, 2**70, "7", 1.0, None, True]))
OPS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.lists(HASHES, max_size=6),
        st.lists(HASHES, max_size=6),
        st.booleans(),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None, database=None)
@given(OPS)
def test_any_sequence_of_events_with_junk_keeps_the_index_as_the_valid_events_alone(ops: list) -> None:
    idx = InMemoryPrefixIndex()
    model: dict[str, set[int]] = {}

    def ok(x: object) -> bool:
        return type(x) is int and 0 <= x < 1 << 64

    logging.disable(logging.WARNING)  # the junk's warnings: hundreds
    try:
        for pod, stored, removed, cleared in ops:
            idx.apply(pod, stored, removed, cleared)
            mine = set() if cleared else model.get(pod, set())
            mine = (mine | {h for h in stored if ok(h)}) - {h for h in removed if ok(h)}
            model[pod] = mine
    finally:
        logging.disable(logging.NOTSET)
    for pod in "abc":
        assert idx.num_blocks(pod) == len(model.get(pod, ()))
    for h in VALID:
        assert idx.match([h]) == {p: 1 for p, s in model.items() if h in s}
    # the reverse map has no dangling pod nor empty entry
    assert all(idx._tiers.values())
    assert all(h in idx._blocks_of[p] for h, pods in idx._tiers.items() for p in pods)


# ------------------------------------------------------------------ SchedulerPool and Watch updates
class FakeScheduler(pb_grpc.SchedulerServicer):
    """A scheduler's Watch stream: ``updates()`` says what each new stream sends, then it idles."""

    def __init__(self, updates: Callable[[], list[pb.PodUpdate]]) -> None:
        self.updates = updates
        self.streams = 0
        self.end = False  # set: the open stream ends (as at a restart)

    async def Watch(self, request: pb.WatchRequest, context: Any) -> AsyncIterator[pb.PodUpdate]:
        self.streams += 1
        sent = self.updates()
        for u in sent:
            yield u
        while not self.end:  # load reports, nothing else
            await asyncio.sleep(request.interval_s)
            yield pb.PodUpdate(model_name=sent[-1].model_name, block_size=sent[-1].block_size)
        self.end = False


def update(model: str, block_size: int, stored: list[int], cleared: bool = True) -> pb.PodUpdate:
    return pb.PodUpdate(model_name=model, block_size=block_size, stored=stored, cleared=cleared)


class _Unheard:
    """A pool listener for tests that only read the index: pods coming and going change nothing."""

    def scheduler_up(self, h: SchedulerHandle) -> None:
        pass

    def scheduler_down(self, h: SchedulerHandle, why: str) -> None:
        pass

    def scheduler_draining(self, h: SchedulerHandle) -> None:
        pass


async def _with_pool(
    updates: Callable[[], list[pb.PodUpdate]], body: Callable[..., Any], **pool_kw: Any
) -> None:
    server = grpc.aio.server()
    fake = FakeScheduler(updates)
    pb_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    index = InMemoryPrefixIndex()
    pool = SchedulerPool(
        [f"127.0.0.1:{port}"], _Unheard(), watch_interval_s=0.02, memory_index=index, **pool_kw
    )
    pool.start()
    try:
        await body(pool, index, fake)
    finally:
        await pool.close()
        await server.stop(0)


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


H = hashes_of(prompt(1, 4))


def test_a_pod_of_this_model_is_indexed() -> None:
    async def body(pool: SchedulerPool, index: InMemoryPrefixIndex, fake: FakeScheduler) -> None:
        await _until(lambda: index.match(H) != {})
        assert pool.healthy() == pool.handles and index.match(H) == {pool.handles[0].address: 4}

    asyncio.run(_with_pool(lambda: [update(MODEL, BS, H)], body, model_name=MODEL, block_size=BS))


def test_a_pods_tiers_and_shared_disk_reach_the_gateways_index_through_its_watch_stream() -> None:
    def updates() -> list[pb.PodUpdate]:
        u = update(MODEL, BS, H)
        u.tiers.extend([DEVICE, HOST, DISK, DISK])  # its last two blocks are on the shared directory
        u.load.disk_location = "dir-1"
        return [u]

    async def body(pool: SchedulerPool, index: InMemoryPrefixIndex, fake: FakeScheduler) -> None:
        await _until(lambda: index.match(H) != {})
        pod = pool.handles[0].address
        assert index.match_tiers(H) == {pod: TierMatch(device=1, host=1)}  # the directory is no pod
        # a pod mounting the same directory loads its blocks too
        assert index.match_tiers(H[2:], {"other:1": "dir-1"}) == {"other:1": TierMatch(disk=2)}
        assert index.match_tiers(H, {pod: "dir-1"}) == {pod: TierMatch(device=1, host=1, disk=2)}

    asyncio.run(_with_pool(updates, body, model_name=MODEL, block_size=BS))


def test_a_pod_serving_another_model_is_refused_logged_once_and_never_indexed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(pool: SchedulerPool, index: InMemoryPrefixIndex, fake: FakeScheduler) -> None:
        await _until(lambda: fake.streams >= 3)  # reconnects, refused each time
        h = pool.handles[0]
        assert not h.healthy and pool.healthy() == [] and index.match(H) == {}
        assert index.num_blocks(h.address) == 0 and "other-model" in (h.refused or "")

    with caplog.at_level(logging.INFO, logger=POOL):
        asyncio.run(_with_pool(lambda: [update("other-model", BS, H)], body, model_name=MODEL, block_size=BS))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name == POOL]
    assert len(errors) == 1, errors
    assert "serves model 'other-model', not 'm': refused" in errors[0]
    assert not any("is up" in r.getMessage() for r in caplog.records)


def test_a_pod_that_switches_to_another_model_goes_down_and_leaves_the_index() -> None:
    calls: list[int] = []

    def updates() -> list[pb.PodUpdate]:
        calls.append(1)
        return [update(MODEL if len(calls) == 1 else "other", BS, H)]

    async def body(pool: SchedulerPool, index: InMemoryPrefixIndex, fake: FakeScheduler) -> None:
        await _until(lambda: index.match(H) != {})
        fake.end = True  # restarted: its next stream says "other"
        await _until(lambda: fake.streams >= 3)
        assert index.match(H) == {} and pool.healthy() == [] and not pool.handles[0].healthy

    asyncio.run(_with_pool(updates, body, model_name=MODEL, block_size=BS))


def test_a_pod_with_another_block_size_is_routed_to_but_not_indexed(caplog: pytest.LogCaptureFixture) -> None:
    async def body(pool: SchedulerPool, index: InMemoryPrefixIndex, fake: FakeScheduler) -> None:
        await _until(lambda: pool.healthy() != [])
        await asyncio.sleep(0.1)
        assert index.match(H) == {} and index.num_blocks(pool.handles[0].address) == 0

    with caplog.at_level(logging.ERROR, logger=POOL):
        asyncio.run(_with_pool(lambda: [update(MODEL, 2 * BS, H)], body, model_name=MODEL, block_size=BS))
    records = [r for r in caplog.records if r.name == POOL]  # not the fake server's cancelled streams
    assert len(records) == 1, [r.getMessage() for r in records]
    msg = records[0].getMessage()
    assert f"hashes blocks of {2 * BS} tokens, not {BS}: routed to, its block events not indexed" in msg


@pytest.mark.parametrize("kw", [{}, {"model_name": MODEL, "block_size": BS}])
def test_unset_fields_or_an_unchecked_pool_accept_the_pod(kw: dict[str, Any]) -> None:
    """A pod that names no model nor block size (an older one), or a pool told none: as before."""

    async def body(pool: SchedulerPool, index: InMemoryPrefixIndex, fake: FakeScheduler) -> None:
        await _until(lambda: index.match(H) != {})

    asyncio.run(_with_pool(lambda: [update("", 0, H)], body, **kw))
    if kw:
        asyncio.run(_with_pool(lambda: [update("other", 2 * BS, H)], body))  # unchecked: indexed
