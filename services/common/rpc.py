"""gRPC as every service uses it: the generated stubs (``pb``, ``pb_grpc``), the channel and server
options, and ``listen`` / ``channel``, through which every port and channel of the services goes
(TLS or plaintext: tls.py). Health checking is health.py's, the proto conversions wire.py's, the
ordered client-stream sender stream_sender.py's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from radixserve.common import protogen
from radixserve.common.tls import TLS

protogen.ensure()  # a source checkout whose contract changed since install regenerates here

from radixserve.common.pb import radixserve_pb2 as pb  # noqa: E402
from radixserve.common.pb import radixserve_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]

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


def listen(server: grpc.Server | grpc.aio.Server, address: str, tls: TLS | None = None) -> int:
    """Serve ``address`` on ``server``: TLS with ``tls``, else plaintext. The port bound; OSError
    when it cannot be (taken, a bad address)."""
    try:
        if tls is None:
            port = int(server.add_insecure_port(address))
        else:
            port = int(server.add_secure_port(address, tls.server_credentials()))
    except RuntimeError as e:  # gRPC's "Failed to bind to address"
        raise OSError(f"cannot listen on {address}: {e}") from e
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


def channel(
    address: str, tls: TLS | None = None, options: Sequence[tuple[str, object]] = CHANNEL_OPTIONS
) -> grpc.Channel:
    """A channel to ``address``: TLS with ``tls`` (the server's certificate checked), else plaintext."""
    return _open(grpc, address, tls, options)


def aio_channel(
    address: str, tls: TLS | None = None, options: Sequence[tuple[str, object]] = CHANNEL_OPTIONS
) -> grpc.aio.Channel:
    """``channel`` for asyncio."""
    return _open(grpc.aio, address, tls, options)


def _open(mod: Any, address: str, tls: TLS | None, options: Sequence[tuple[str, object]]) -> Any:
    """``mod`` (grpc or grpc.aio)'s channel: plaintext, or TLS with ``tls``'s name override."""
    if tls is None:
        return mod.insecure_channel(address, options=list(options))
    opts = [*options, *tls.channel_options()]
    return mod.secure_channel(address, tls.channel_credentials(), options=opts)
