"""gRPC plumbing every service shares: the generated stubs, channel options, health checking,
sampling-parameter conversion and an ordered client-stream sender."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, Final, Literal, TypeAlias

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixserve.common import protogen
from radixserve.common.sampling import SamplingParams

protogen.ensure()  # a source checkout whose contract changed since install regenerates here

from radixserve.common.pb import radixserve_pb2 as pb  # noqa: E402
from radixserve.common.pb import radixserve_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Notice a peer that vanished without closing its connections (a killed pod) within seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect to a restarted pod within a second (gRPC's default backoff grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),  # a port already taken is an error, not a shared listener
]


# ------------------------------------------------------------------------- health checking
def add_health(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    """Serve grpc.health.v1 (what Kubernetes gRPC probes call) for "" and each service name."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def set_not_serving(servicer: health.HealthServicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def is_serving(address: str, timeout: float = 1.0) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


# ------------------------------------------------------------------------------- sampling
def sampling_to_proto(sp: SamplingParams, skip_special_tokens: bool = True) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        stop_token_ids=list(sp.stop_token_ids),
        stop=list(sp.stop),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=skip_special_tokens,
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    return msg


def sampling_from_proto(msg: pb.SamplingParams, default_max_new_tokens: int | None = None) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults (max_new_tokens: the given default)."""
    sp = SamplingParams()
    if default_max_new_tokens is not None:
        sp.max_new_tokens = default_max_new_tokens
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed"):
        if msg.HasField(name):
            setattr(sp, name, getattr(msg, name))
    sp.stop_token_ids = tuple(msg.stop_token_ids)
    sp.stop = tuple(msg.stop)
    sp.ignore_eos = msg.ignore_eos
    return sp


# ------------------------------------------------------------------------ stream sender
class _Close(Enum):
    CLOSE = "close"


_CLOSE: Final = _Close.CLOSE  # queued by close(): the end of the call

# A queued message (opaque to the sender: gRPC serializes it) and what to run once it is taken.
_Item: TypeAlias = tuple[object, Callable[[], None] | None]


class StreamSender:
    """Sends messages, in order, over one long-lived client-streaming call to ``address``.

    ``send`` never blocks the caller (the engine loop): a thread owns the call. The call waits for
    the peer to be ready and is reopened after a failure; while the peer is gone, messages queue up
    to ``max_queued`` and the oldest are dropped beyond that (logged), so a dead peer cannot grow
    this process without bound.
    """

    def __init__(
        self,
        address: str,
        open_call: Callable[[grpc.Channel], Callable[..., object]],
        max_queued: int = 100_000,
        name: str = "sender",
        encode: Callable[[Any], object] | None = None,
    ) -> None:
        """``encode``: turns what ``send`` was given into the message to write, on the sender
        thread (the engine thread hands over plain objects and goes on)."""
        self.address = address
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
        """Send what is queued, then end the call."""
        if not self._closed:
            self._closed = True
            self._queue.put(_CLOSE)
            self._thread.join(timeout)

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
        while True:
            done = [False]
            channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            try:
                self._open_call(channel)(self._messages(done), wait_for_ready=True)
                backoff = 0.05
            except grpc.RpcError as e:
                if not done[0]:
                    self.errors += 1
                    log.warning("stream to %s broke (%s); reopening", self.address, e.code())
            finally:
                channel.close()
            if done[0]:
                return
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)
