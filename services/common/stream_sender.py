"""An ordered sender over one gRPC client stream (scheduler -> detokenizer, detokenizer -> gateway):
messages queued by any thread go out in order, each with what to run once it is taken."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, Final, Literal, TypeAlias

import grpc

from radixserve.common.rpc import channel
from radixserve.common.tls import TLS

log = logging.getLogger(__name__)


class _Close(Enum):
    CLOSE = "close"


_CLOSE: Final = _Close.CLOSE  # queued by close(): the end of the call

# A queued message (opaque to the sender: gRPC serializes it) and what to run once it is taken.
_Item: TypeAlias = tuple[object, Callable[[], None] | None]


CLOSE_IDLE_S = 0.5  # StreamSender.close with nothing queued: how long the call's end may take
# With several peers: how long one may take to accept a connection before the next one is tried.
CONNECT_S = 1.0


class StreamSender:
    """Sends messages, in order, over one long-lived client-streaming call to ``address``.

    ``send`` never blocks the caller (the engine loop): a thread owns the call. The call waits for
    the peer to be ready and is reopened after a failure; while the peer is gone, messages queue up
    to ``max_queued`` and the oldest are dropped beyond that (logged), so a dead peer cannot grow
    this process without bound.

    ``address`` may name several peers, comma-separated (replicas of one service: a scheduler's
    detokenizers): the call goes to the first that accepts, and after a failure to the next one
    (each gets ``CONNECT_S`` to accept), so a dead replica's traffic moves to a live one at once.
    What was in flight on the broken call is lost either way: the receiving side rebuilds it
    (a gateway continues the streams it was delivering, see tokenizer/routing/failover.py).
    """

    def __init__(
        self,
        address: str,
        open_call: Callable[[grpc.Channel], Callable[..., object]],
        max_queued: int = 100_000,
        name: str = "sender",
        encode: Callable[[Any], object] | None = None,
        tls: TLS | None = None,
    ) -> None:
        """``encode``: turns what ``send`` was given into the message to write, on the sender
        thread (the engine thread hands over plain objects and goes on). ``tls``: see ``channel``."""
        self.address = address
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.peer = 0  # index in ``addresses`` of the one the call goes to
        self._tls = tls
        self._encode = encode
        self._open_call = open_call
        self._queue: queue.Queue[_Item | Literal[_Close.CLOSE]] = queue.Queue()
        self._max_queued = max_queued
        self._closed = False
        self.dropped = 0  # messages dropped while the peer was unreachable
        self.errors = 0  # broken streams
        self._thread = threading.Thread(target=self._run, name=f"{name}->{address}", daemon=True)
        self._thread.start()

    def send(self, message: object, on_taken: Callable[[], None] | None = None) -> None:
        """Queue ``message``; ``on_taken`` runs (on the sender thread) once it leaves this process's
        queue: handed to gRPC for writing, or dropped."""
        if self._closed:
            return
        self._queue.put((message, on_taken))
        while self._queue.qsize() > self._max_queued:
            try:
                item = self._queue.get_nowait()
                if item is _CLOSE:  # close() raced with this send: the end of the call stays queued
                    self._queue.put(item)
                    break
                _, dropped_cb = item
                if dropped_cb is not None:
                    dropped_cb()
                self.dropped += 1
                log.warning(
                    "%s unreachable: dropped a queued message (%d so far)", self.address, self.dropped
                )
            except queue.Empty:
                break

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for up to ``timeout``), then end the call. With nothing queued only
        the call's end is left, which a live peer takes at once: a peer that is gone (at a shutdown
        the gateway usually goes first) must not hold this process for ``timeout`` as well."""
        if not self._closed:
            self._closed = True
            idle = self._queue.empty()
            self._queue.put(_CLOSE)
            self._thread.join(min(timeout, CLOSE_IDLE_S) if idle else timeout)

    def _messages(self, done: list[bool]) -> Iterator[object]:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                done[0] = True
                return
            msg, on_taken = item
            if on_taken is not None:
                on_taken()
            yield msg if self._encode is None else self._encode(msg)

    def _run(self) -> None:
        backoff = 0.05
        several = len(self.addresses) > 1
        while True:
            done = [False]
            address = self.addresses[self.peer]
            ch = channel(address, self._tls)
            try:
                if several and not self._accepts(ch):
                    self.peer = (self.peer + 1) % len(self.addresses)
                    continue
                self._open_call(ch)(self._messages(done), wait_for_ready=True)
                backoff = 0.05
            except grpc.RpcError as e:
                if not done[0]:
                    self.errors += 1
                    self.peer = (self.peer + 1) % len(self.addresses)
                    log.warning(
                        "stream to %s broke (%s); reopening to %s",
                        address,
                        e.code(),
                        self.addresses[self.peer],
                    )
            finally:
                ch.close()
            if done[0]:
                return
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    def _accepts(self, ch: grpc.Channel) -> bool:
        try:
            grpc.channel_ready_future(ch).result(timeout=CONNECT_S)
            return True
        except grpc.FutureTimeoutError:
            return False
