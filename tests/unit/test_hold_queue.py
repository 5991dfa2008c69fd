"""The gateway's hold queue (routing/hold_queue.py): requests wait for a scheduler in arrival order,
bounded, timed out, and leave it when their client goes; the gauge follows."""

from __future__ import annotations

import asyncio

import pytest

from radixserve.common.config import ConfigError, check
from radixserve.common.service_config import GatewayConfig
from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.routing.hold_queue import HoldQueue


class _World:
    """Whether a scheduler is up, and the order in which requests got their turn."""

    def __init__(self) -> None:
        self.up = False
        self.order: list[int] = []
        self.gauge: list[int] = []


async def _request(q: HoldQueue, w: _World, i: int) -> float | None:
    async with q.turn() as held:
        await asyncio.sleep(0.001)  # a submission takes a moment: the next one waits for it
        w.order.append(i)
        return None if held is None else held.until - held.since


def test_held_requests_go_in_arrival_order_once_a_scheduler_is_up() -> None:
    async def main() -> None:
        w = _World()
        q = HoldQueue(8, 30.0, ready=lambda: w.up, on_change=w.gauge.append)
        tasks = [asyncio.create_task(_request(q, w, i)) for i in range(8)]
        await asyncio.sleep(0.05)
        assert q.held == 8 and w.gauge[-1] == 8 and w.order == []
        with pytest.raises(ApiError) as full:
            await _request(q, w, 99)
        assert full.value.status == 429 and full.value.retry_after == 30
        assert "--max-held-requests" in full.value.message
        w.up = True
        q.wake()
        late = asyncio.create_task(_request(q, w, 8))  # came after them: goes after them
        held = await asyncio.gather(*tasks, late)
        assert w.order == list(range(9))
        assert all(h is not None and h >= 0.04 for h in held[:8]) and held[8] is not None
        assert q.held == 0 and w.gauge[-1] == 0 and q.released == 9
        assert await _request(q, w, 10) is None  # nothing held, a scheduler up: straight through

    asyncio.run(main())


def test_a_held_request_whose_client_leaves_is_never_released_and_a_timeout_is_a_503() -> None:
    async def main() -> None:
        w = _World()
        q = HoldQueue(4, 0.2, ready=lambda: w.up, on_change=w.gauge.append)
        gone = asyncio.create_task(_request(q, w, 0))
        stays = asyncio.create_task(_request(q, w, 1))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        assert q.held == 1
        with pytest.raises(ApiError) as late:
            await stays
        assert late.value.status == 503 and "--hold-timeout" in late.value.message
        assert late.value.retry_after == 1 and q.held == 0 and w.order == [] and q.timed_out == 1
        w.up = True
        q.wake()
        assert await _request(q, w, 2) is None and w.order == [2]

    asyncio.run(main())


def test_hold_off_fails_at_once_as_before() -> None:
    async def main() -> None:
        q = HoldQueue(8, 0.0, ready=lambda: False)
        async with q.turn() as held:  # not held: routing itself answers the 503
            assert held is None
        assert not q.enabled

    asyncio.run(main())


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"hold_timeout": 900.0}, "--hold-timeout 900: over 600 s"),
        ({"hold_timeout": 5.0, "max_held_requests": 0}, "--max-held-requests 0 holds none"),
    ],
)
def test_hold_settings_that_cannot_work_are_refused_naming_them(fields: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        check(GatewayConfig(schedulers=("a:1",), **fields))


@pytest.mark.parametrize("argv", [["--max-held-requests", "-1"], ["--max-held-requests", "1000000"]])
def test_a_negative_or_absurd_queue_size_is_refused_by_its_flag(argv: list[str]) -> None:
    from radixserve.common.config import RaisingParser, from_args
    from radixserve.tokenizer.__main__ import build_parser

    parser = build_parser(RaisingParser)
    with pytest.raises(ConfigError, match="--max-held-requests"):
        from_args(GatewayConfig, parser.parse_args(["--model", "m", "--schedulers", "a:1", *argv]))


def test_a_client_deadline_shorter_than_the_hold_is_answered_before_it_runs_out() -> None:
    async def main() -> None:
        q = HoldQueue(4, 60.0, ready=lambda: False)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ApiError) as e:
            async with q.turn(deadline_s=3.0):
                pass
        waited = loop.time() - t0
        assert e.value.status == 503 and "this request's deadline (3 s" in e.value.message
        # before the client's own deadline (answered at 0.9 of it; 0.3 s of room for a late timer)
        assert 2.6 <= waited < 3.0 and q.held == 0

    asyncio.run(main())
