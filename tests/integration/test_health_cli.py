"""``python -m radixserve.common.health``: the exec probe the operator uses when gRPC runs with TLS.
A real grpc.health.v1 server on loopback, plaintext, TLS and mutual TLS (tests/certs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from radixserve.common import health
from radixserve.common.health import add_health, set_not_serving
from radixserve.common.ports import free_port
from radixserve.common.rpc import SERVER_OPTIONS, listen
from radixserve.common.service_config import TLSConfig
from radixserve.common.tls import TLS, load_tls
from tests.certs import CertFiles, make_certs

TLS_VARS = ("CERT", "KEY", "CA", "CLIENT_AUTH", "SERVER_NAME")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(autouse=True)
def no_tls_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TLS_VARS:
        monkeypatch.delenv(f"RADIXSERVE_TLS_{var}", raising=False)


@pytest.fixture
def serve() -> Iterator:
    """Starts grpc.health.v1 on a free loopback port; returns (address, servicer)."""
    servers: list[grpc.Server] = []

    def start(tls: TLS | None = None):  # type: ignore[no-untyped-def]
        server = grpc.server(futures.ThreadPoolExecutor(2), options=SERVER_OPTIONS)
        servicer = add_health(server, [])
        port = listen(server, "127.0.0.1:0", tls)
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", servicer

    yield start
    for s in servers:
        s.stop(None)


def server_tls(c: CertFiles, client_auth: bool = False) -> TLS | None:
    cfg = TLSConfig(tls_cert=c.server_cert, tls_key=c.server_key, tls_ca=c.ca, tls_client_auth=client_auth)
    return load_tls(cfg)


def tls_env(monkeypatch: pytest.MonkeyPatch, c: CertFiles, client: bool = True, **extra: str) -> None:
    """The pod's RADIXSERVE_TLS_* (its certificate: ``c``'s client one, signed by the same CA)."""
    cert, key = (c.client_cert, c.client_key) if client else (c.server_cert, c.server_key)
    monkeypatch.setenv("RADIXSERVE_TLS_CERT", cert)
    monkeypatch.setenv("RADIXSERVE_TLS_KEY", key)
    monkeypatch.setenv("RADIXSERVE_TLS_CA", c.ca)
    for name, value in extra.items():
        monkeypatch.setenv(f"RADIXSERVE_TLS_{name.upper()}", value)


def test_serving_is_0_and_not_serving_is_1(serve):
    address, servicer = serve()
    assert health.main([address]) == 0
    set_not_serving(servicer, [])
    assert health.main([address]) == 1


def test_nothing_listening_is_1(serve):
    address, _ = serve()
    closed = f"127.0.0.1:{free_port()}"
    assert health.main([closed, "--timeout", "0.5"]) == 1
    assert health.main([address]) == 0


def test_the_command_line_runs_as_a_module(serve):
    address, servicer = serve()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_TLS_")}
    run = [sys.executable, "-m", "radixserve.common.health", address, "--timeout", "5"]
    assert subprocess.run(run, env=env, timeout=60).returncode == 0
    set_not_serving(servicer, [])
    done = subprocess.run(run, env=env, timeout=60, capture_output=True, text=True)
    assert done.returncode == 1 and "not serving" in done.stderr


def test_tls_with_the_pods_settings(certs, serve, monkeypatch):
    address, _ = serve(server_tls(certs))
    assert health.main([address]) == 1  # plaintext to a TLS port: refused
    tls_env(monkeypatch, certs, server_name="localhost")
    assert health.main([address]) == 0


def test_mutual_tls(certs, serve, monkeypatch):
    address, _ = serve(server_tls(certs, client_auth=True))
    tls_env(monkeypatch, certs, client_auth="true", server_name="localhost")
    assert health.main([address]) == 0


def test_bad_tls_settings_are_2(certs, monkeypatch, capsys):
    monkeypatch.setenv("RADIXSERVE_TLS_CERT", certs.server_cert)
    assert health.main(["127.0.0.1:1"]) == 2
    assert "RADIXSERVE_TLS_KEY" in capsys.readouterr().err
