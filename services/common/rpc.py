"""gRPC plumbing every service shares: the generated stubs, channel options, TLS (``listen`` and
``channel``: every port and channel of the services), health checking, sampling-parameter
conversion and an ordered client-stream sender."""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final, Literal, TypeAlias

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixserve.common import protogen
from radixserve.common.config import env_flag, env_name, flag_fields
from radixserve.common.sampling import Constraint, SamplingParams
from radixserve.common.service_config import TLSConfig

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


# ------------------------------------------------------------------------------------- TLS
class TLSError(ValueError):
    """TLS settings that cannot work (a file missing or unreadable, a key that is not the
    certificate's, a setting without the others it needs): the process must not start."""


@dataclass(frozen=True, slots=True)
class TLS:
    """A process's TLS material, read once at start (``load_tls``): its gRPC port serves ``cert``
    (requiring client certificates signed by ``ca`` with ``client_auth``); its channels verify
    servers against ``ca`` (and the name ``server_name`` if set, else the host dialed) and present
    ``cert`` when a server asks for one. ``cert``/``key`` None: a client that has none (tests)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)  # never in a log line
    client_auth: bool = False
    server_name: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.cert is not None and self.key is not None, "a TLS port needs a certificate and key"
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if self.client_auth else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        # The certificate goes along even without client_auth here: a server asks for it only when
        # it requires one, and mutual TLS can then be switched on pod by pod.
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def channel_options(self) -> list[tuple[str, object]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')} ({env_name(name)})"


def _read(name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TLSError(f"{_flag(name)}: cannot read {path}: {e.strerror or e}") from e
    if b"-----BEGIN " not in data:
        raise TLSError(f"{_flag(name)}: {path} is not PEM (no -----BEGIN line)")
    return data


def _no_password() -> bytes:
    raise TLSError("the key is encrypted (a passphrase is not supported: mount the key unencrypted)")


def load_tls(cfg: TLSConfig) -> TLS | None:
    """The TLS of ``cfg``'s files, read and checked now (the key is the certificate's, the CA bundle
    parses); None when no file is set (plaintext gRPC). TLSError says which setting is wrong."""
    paths = {"tls_cert": cfg.tls_cert, "tls_key": cfg.tls_key, "tls_ca": cfg.tls_ca}
    missing = [n for n, v in paths.items() if not v]
    if len(missing) == len(paths):
        for name in ("tls_client_auth", "tls_server_name"):
            if getattr(cfg, name):
                raise TLSError(f"{_flag(name)} needs TLS: set --tls-cert, --tls-key and --tls-ca")
        return None
    if missing:
        given = ", ".join(_flag(n) for n, v in paths.items() if v)
        raise TLSError(
            f"TLS needs --tls-cert, --tls-key and --tls-ca together: {given} set,"
            f" {', '.join(_flag(n) for n in missing)} not"
        )
    assert cfg.tls_cert and cfg.tls_key and cfg.tls_ca
    cert, key = _read("tls_cert", cfg.tls_cert), _read("tls_key", cfg.tls_key)
    ca = _read("tls_ca", cfg.tls_ca)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key, password=_no_password)
    except (ssl.SSLError, TLSError) as e:
        raise TLSError(
            f"{_flag('tls_cert')} {cfg.tls_cert} and {_flag('tls_key')} {cfg.tls_key} do not make a"
            f" certificate and its key: {e}"
        ) from e
    try:
        ctx.load_verify_locations(cadata=ca.decode("ascii", errors="replace"))
    except ssl.SSLError as e:
        raise TLSError(f"{_flag('tls_ca')}: {cfg.tls_ca} holds no usable CA certificate: {e}") from e
    return TLS(ca, cert, key, cfg.tls_client_auth, cfg.tls_server_name or None)


def tls_from_env(environ: Mapping[str, str]) -> TLS | None:
    """``load_tls`` of the RADIXSERVE_TLS_* variables in ``environ`` (what a launcher hands its
    services: it probes them with the same settings)."""
    values: dict[str, object] = {}
    for name, f in flag_fields(TLSConfig).items():
        raw = environ.get(env_name(name))
        if raw is not None:
            values[name] = env_flag(raw) if f.default is False else raw
    return load_tls(TLSConfig(**values))  # type: ignore[arg-type]


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


def is_serving(address: str, timeout: float = 1.0, tls: TLS | None = None, service: str = "") -> bool:
    """Whether the gRPC health service ``service`` at ``address`` reports SERVING ("": the server's)."""
    try:
        with channel(address, tls, options=()) as ch:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = health_pb2_grpc.HealthStub(ch).Check(request, timeout=timeout)
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
        logit_bias=dict(sp.logit_bias),
        include_stop_str=sp.include_stop_str,
    )
    for name, default in _OPTIONAL.items():
        if getattr(sp, name) != default:
            setattr(msg, name, getattr(sp, name))
    if sp.constraint is not None:
        msg.constraint.kind = sp.constraint.kind
        msg.constraint.spec = sp.constraint.spec
    return msg


# Optional proto fields, set only away from SamplingParams' default: name -> default.
_OPTIONAL = {
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "min_new_tokens": 0,
}


def sampling_from_proto(msg: pb.SamplingParams, default_max_new_tokens: int | None = None) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults (max_new_tokens: the given default)."""
    sp = SamplingParams()
    if default_max_new_tokens is not None:
        sp.max_new_tokens = default_max_new_tokens
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", *_OPTIONAL):
        if msg.HasField(name):
            setattr(sp, name, getattr(msg, name))
    sp.stop_token_ids = tuple(msg.stop_token_ids)
    sp.stop = tuple(msg.stop)
    sp.ignore_eos = msg.ignore_eos
    sp.include_stop_str = msg.include_stop_str
    sp.logit_bias = tuple(sorted(msg.logit_bias.items()))
    if msg.HasField("constraint"):
        sp.constraint = Constraint(msg.constraint.kind, msg.constraint.spec)
    return sp


def logprobs_to_proto(entries: Sequence[tuple[float, list[int], list[float]] | None]) -> pb.Logprobs:
    """(logprob, top ids, top logprobs) per token as a ``Logprobs``; None (a prompt's first token,
    which nothing predicts) is NaN with no alternatives."""
    msg = pb.Logprobs()
    alternatives = any(e is not None and e[1] for e in entries)
    for e in entries:
        msg.logprob.append(float("nan") if e is None else e[0])
        if alternatives:
            msg.top.add(token_ids=e[1] if e else (), logprobs=e[2] if e else ())
    return msg


# ------------------------------------------------------------------------ stream sender
class _Close(Enum):
    CLOSE = "close"


_CLOSE: Final = _Close.CLOSE  # queued by close(): the end of the call

# A queued message (opaque to the sender: gRPC serializes it) and what to run once it is taken.
_Item: TypeAlias = tuple[object, Callable[[], None] | None]


CLOSE_IDLE_S = 0.5  # StreamSender.close with nothing queued: how long the call's end may take


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
        tls: TLS | None = None,
    ) -> None:
        """``encode``: turns what ``send`` was given into the message to write, on the sender
        thread (the engine thread hands over plain objects and goes on). ``tls``: see ``channel``."""
        self.address = address
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
        while True:
            done = [False]
            ch = channel(self.address, self._tls)
            try:
                self._open_call(ch)(self._messages(done), wait_for_ready=True)
                backoff = 0.05
            except grpc.RpcError as e:
                if not done[0]:
                    self.errors += 1
                    log.warning("stream to %s broke (%s); reopening", self.address, e.code())
            finally:
                ch.close()
            if done[0]:
                return
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)
