"""Requests held at the gateway while no scheduler of its model serves (scale to zero and back).

With ``--hold-timeout`` > 0 a request that finds no scheduler waits here instead of failing at once:

    no scheduler, queue not full   it waits, in arrival order (the ``held`` gauge, and the gateway's
                                   load report in Redis, count it: the activation signal that scales
                                   the schedulers from zero)
    queue full                     429 (``--max-held-requests``), with Retry-After
    held ``timeout_s``             503, with Retry-After
    client gone                    it leaves the queue (its task is cancelled) and is never sent
    a scheduler is up              the gateway calls ``wake``: the held requests go, oldest first

They go one at a time: each request's turn ends when its submission has (``Turn``), then the next
one's begins, so a scheduler admits them in the order they came. A new request that arrives while
some are still held queues behind them, not past them. With the hold off (timeout 0) ``turn``
holds nothing: a request without a scheduler fails with 503 as it always did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from radixserve.common.prefix_index import gateway_reports
from radixserve.common.service_config import RoutingConfig
from radixserve.tokenizer.errors import ApiError

log = logging.getLogger(__name__)


# A request whose client's deadline is shorter than the hold waits this share of it: the rest is for
# the 503 to reach the client before its own deadline turns the wait into a bare DEADLINE_EXCEEDED.
DEADLINE_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Held:
    """A request's wait in the queue (time.monotonic()): for its trace."""

    since: float
    until: float
    position: int  # requests ahead of it when it came


class HoldQueue:
    """``ready``: whether a request could be routed now (some scheduler is up); ``on_change``: called
    with the held count whenever it changes (the gauge). ``timeout_s`` 0: holding is off."""

    def __init__(
        self,
        max_held: int,
        timeout_s: float,
        ready: Callable[[], bool],
        on_change: Callable[[int], None] = lambda n: None,
    ) -> None:
        if max_held < 0 or timeout_s < 0:
            raise ValueError(f"max_held ({max_held}) and timeout_s ({timeout_s}) must be >= 0")
        self.max_held = max_held
        self.timeout_s = timeout_s
        self._ready = ready
        self._on_change = on_change
        self._waiting: deque[asyncio.Future[None]] = deque()  # oldest first
        self._turn_taken = False  # a released request is being submitted: the next one waits for it
        self.released = 0  # requests that were held and then went to a scheduler
        self.timed_out = 0
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0 and self.max_held > 0

    @property
    def held(self) -> int:
        return len(self._waiting)

    def retry_after_s(self) -> int:
        """What a refused client is told to wait: the hold's length, at least a second."""
        return max(1, round(self.timeout_s))

    @asynccontextmanager
    async def turn(self, deadline_s: float | None = None) -> AsyncIterator[Held | None]:
        """The request's turn to be routed and submitted (inside the block); yields how it was held
        (None: it was not). Raises ApiError 429 (full) or 503 (held ``timeout_s``, or for most of
        ``deadline_s``, the seconds its client still waits (a gRPC deadline), if that is shorter: the
        client hears why before its own deadline cuts it off)."""
        if not self.enabled or (not self._waiting and not self._turn_taken and self._ready()):
            yield None
            return
        if len(self._waiting) >= self.max_held:
            self.refused += 1
            raise ApiError(
                429,
                f"no scheduler is serving yet and {self.max_held} requests are already held"
                " (--max-held-requests); retry later",
                "rate_limit_error",
                retry_after=self.retry_after_s(),
            )
        since, position = time.monotonic(), len(self._waiting)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(mine)
        self._changed()
        limit, why = self.timeout_s, f"the {self.timeout_s:g} s this request was held (--hold-timeout)"
        if deadline_s is not None and deadline_s * DEADLINE_SHARE < limit:
            limit = max(0.0, deadline_s * DEADLINE_SHARE)
            why = f"this request's deadline ({deadline_s:.3g} s, under the gateway's --hold-timeout)"
        try:
            await asyncio.wait_for(asyncio.shield(mine), limit)
        except (TimeoutError, asyncio.TimeoutError):  # two classes before Python 3.11
            if not self._released(mine):
                self.timed_out += 1
                raise ApiError(
                    503,
                    f"no scheduler came up within {why}; retry the request",
                    "server_error",
                    retry_after=self.retry_after_s(),
                ) from None
        except BaseException:  # cancelled: the client went away
            if mine.done() and not mine.cancelled():  # released in the same instant: pass the turn on
                self._end_turn()
            else:
                self._released(mine)
            raise
        self.released += 1
        try:
            yield Held(since, time.monotonic(), position)
        finally:
            self._end_turn()

    def wake(self) -> None:
        """A scheduler may be up: release the oldest held request (the next ones follow as each
        one's turn ends)."""
        while self._waiting and not self._turn_taken and self._ready():
            head = self._waiting.popleft()
            self._changed()
            if head.done():  # cancelled meanwhile (its waiter removes nothing: it is gone already)
                continue
            head.set_result(None)
            self._turn_taken = True

    def _released(self, mine: asyncio.Future[None]) -> bool:
        """Whether ``mine`` got its turn; if not, it leaves the queue."""
        if mine.done() and not mine.cancelled():
            return True
        mine.cancel()
        self._waiting.remove(mine)
        self._changed()
        return False

    def _end_turn(self) -> None:
        self._turn_taken = False
        self.wake()

    def _changed(self) -> None:
        self._on_change(len(self._waiting))


class GatewayReport:
    """This gateway's load report in the prefix index's Redis (``prefix_index.gateway_reports``):
    requests held and in flight, as an expiring heartbeat under its advertised address, published at
    each sweep: the signal the operator scales a service's schedulers from zero on."""

    def __init__(self, routing: RoutingConfig, address: str, hold: HoldQueue) -> None:
        self.reports = gateway_reports(routing.prefix_index, routing.index_key_prefix)
        self.address, self.hold = address, hold
        self.ttl_s = 3 * routing.sweep_s + 2  # outlives two missed sweeps

    def publish(self, in_flight: int) -> None:
        """Raises redis.RedisError when Redis is unreachable (the sweep degrades on it)."""
        self.reports.heartbeat(self.address, {"held": self.hold.held, "in_flight": in_flight}, self.ttl_s)

    def withdraw(self) -> None:
        """At shutdown: it holds nothing any more (best effort: the report expires anyway)."""
        try:
            self.reports.remove_pod(self.address)
        except Exception as e:
            log.info("could not withdraw this gateway's load report: %s", e)
