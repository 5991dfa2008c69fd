"""TLS between the pods: a process's certificate, key and CA, read and checked once at start
(``load_tls``), and the credentials its gRPC port and channels use (rpc.listen / rpc.channel)."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from radixserve.common.config import env_flag, env_name, flag_fields
from radixserve.common.service_config import TLSConfig


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
