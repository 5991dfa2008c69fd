"""gRPC over TLS (rpc.load_tls, listen, channel): a real server on loopback with certificates made
here (tests/certs.py), the clients that get in and the ones that are refused, and the start-up
checks of the settings."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve.common.config import add_flags, from_args, parse_args
from radixserve.common.health import add_health, is_serving
from radixserve.common.rpc import SERVER_OPTIONS, aio_channel, listen
from radixserve.common.service_config import SchedulerPodConfig, TLSConfig
from radixserve.common.tls import TLS, TLSError, load_tls, tls_from_env
from tests.certs import CertFiles, check_code, make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """Certificates of another CA: nothing here trusts them."""
    return make_certs(str(tmp_path_factory.mktemp("other")))


def server_config(c: CertFiles, client_auth: bool = False) -> TLSConfig:
    return TLSConfig(tls_cert=c.server_cert, tls_key=c.server_key, tls_ca=c.ca, tls_client_auth=client_auth)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def client(c: CertFiles, with_cert: bool = False, server_name: str | None = None) -> TLS:
    """A client that trusts ``c``'s CA (presenting ``c``'s client certificate if ``with_cert``)."""
    if not with_cert:
        return TLS(read(c.ca), server_name=server_name)
    return TLS(read(c.ca), read(c.client_cert), read(c.client_key), server_name=server_name)


@pytest.fixture
def serve_health() -> Iterator:
    """Starts grpc.health.v1 on a free loopback port with the given TLS; returns its address."""
    servers: list[grpc.Server] = []

    def start(tls: TLS | None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(2), options=SERVER_OPTIONS)
        add_health(server, [])
        port = listen(server, "127.0.0.1:0", tls)
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None)


# ----------------------------------------------------------------------------- server TLS
def test_tls_port_serves_clients_that_trust_its_ca(certs, serve_health):
    address = serve_health(load_tls(server_config(certs)))
    assert is_serving(address, 5, tls=client(certs))
    assert is_serving(address.replace("127.0.0.1", "localhost"), 5, tls=client(certs))
    assert is_serving(address, 5, tls=load_tls(server_config(certs)))  # a service dialing a peer


def test_tls_port_refuses_plaintext_and_other_cas(certs, other, serve_health):
    address = serve_health(load_tls(server_config(certs)))
    assert check_code(address, None) == grpc.StatusCode.UNAVAILABLE
    assert check_code(address, client(other)) == grpc.StatusCode.UNAVAILABLE
    assert check_code(address, client(certs)) == grpc.StatusCode.OK


def test_tls_client_refuses_a_plaintext_server(certs, serve_health):
    address = serve_health(None)
    assert is_serving(address, 5)
    assert check_code(address, client(certs)) == grpc.StatusCode.UNAVAILABLE


def test_server_name_is_checked_against_the_certificate(certs, serve_health):
    address = serve_health(load_tls(server_config(certs)))
    assert check_code(address, client(certs, server_name="localhost")) == grpc.StatusCode.OK
    assert check_code(address, client(certs, server_name="elsewhere.example")) == grpc.StatusCode.UNAVAILABLE


def test_aio_channel_speaks_tls(certs, serve_health):
    address = serve_health(load_tls(server_config(certs)))

    async def check() -> int:
        async with aio_channel(address, client(certs)) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return int(reply.status)

    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING


# ----------------------------------------------------------------------------- mutual TLS
def test_mutual_tls_wants_a_client_certificate_from_its_ca(certs, other, serve_health):
    address = serve_health(load_tls(server_config(certs, client_auth=True)))
    assert check_code(address, client(certs, with_cert=True)) == grpc.StatusCode.OK
    assert check_code(address, load_tls(server_config(certs))) == grpc.StatusCode.OK  # a peer service
    assert check_code(address, client(certs)) == grpc.StatusCode.UNAVAILABLE  # no certificate
    assert check_code(address, None) == grpc.StatusCode.UNAVAILABLE
    # a certificate of another CA, the server's CA trusted
    stranger = TLS(read(certs.ca), read(other.client_cert), read(other.client_key))
    assert check_code(address, stranger) == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------------- start-up checks
def test_no_settings_is_plaintext():
    assert load_tls(TLSConfig()) is None
    assert load_tls(TLSConfig(tls_cert="", tls_key="", tls_ca="")) is None
    assert tls_from_env({}) is None


@pytest.mark.parametrize("unset", ["tls_cert", "tls_key", "tls_ca"])
def test_tls_needs_all_three_files(certs, unset):
    with pytest.raises(TLSError, match=f"--{unset.replace('_', '-')} .RADIXSERVE_{unset.upper()}. not"):
        load_tls(replace(server_config(certs), **{unset: None}))


@pytest.mark.parametrize(
    ("setting", "value"), [("tls_client_auth", True), ("tls_server_name", "radixserve.internal")]
)
def test_tls_options_without_tls_are_an_error(setting, value):
    with pytest.raises(TLSError, match=f"--{setting.replace('_', '-')} .* needs TLS"):
        load_tls(TLSConfig(**{setting: value}))


def test_unreadable_or_wrong_files_are_named(certs, other, tmp_path):
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(TLSError, match=f"--tls-cert .*cannot read {missing}"):
        load_tls(replace(server_config(certs), tls_cert=missing))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TLSError, match=r"--tls-ca .*not PEM"):
        load_tls(replace(server_config(certs), tls_ca=str(garbage)))
    with pytest.raises(TLSError, match="do not make a certificate and its key"):
        load_tls(replace(server_config(certs), tls_key=other.server_key))  # another certificate's key
    with pytest.raises(TLSError, match=r"--tls-ca .*no usable CA certificate"):
        load_tls(replace(server_config(certs), tls_ca=certs.server_key))  # a key, not a certificate


def test_settings_are_flags_and_variables(certs, monkeypatch):
    for var in [v for v in os.environ if v.startswith("RADIXSERVE_")]:
        monkeypatch.delenv(var)
    import argparse

    p = argparse.ArgumentParser()
    add_flags(p, SchedulerPodConfig)
    argv = ["--detokenizer", "d:1", "--tls-cert", certs.server_cert, "--tls-key", certs.server_key]
    monkeypatch.setenv("RADIXSERVE_TLS_CA", certs.ca)
    monkeypatch.setenv("RADIXSERVE_TLS_CLIENT_AUTH", "true")
    cfg = from_args(SchedulerPodConfig, parse_args(p, argv))
    assert cfg.tls == server_config(certs, client_auth=True)
    env = {"RADIXSERVE_TLS_CERT": certs.server_cert, "RADIXSERVE_TLS_KEY": certs.server_key}
    env |= {"RADIXSERVE_TLS_CA": certs.ca, "RADIXSERVE_TLS_CLIENT_AUTH": "1"}
    assert tls_from_env(env) == load_tls(cfg.tls) == load_tls(server_config(certs, client_auth=True))


def test_listen_names_a_port_it_cannot_take(serve_health):
    address = serve_health(None)
    server = grpc.server(futures.ThreadPoolExecutor(1), options=SERVER_OPTIONS)
    with pytest.raises(OSError, match=f"cannot listen on {address}"):
        listen(server, address)
