"""Throwaway certificates for TLS tests, made with the openssl CLI.

    certs = make_certs(str(tmp_path))   # CertFiles: paths of PEM files in tmp_path
    certs.ca, certs.server_cert, certs.server_key, certs.client_cert, certs.client_key

A CA, a server certificate it signed for 127.0.0.1 and localhost (both in the subject alternative
names: clients check those, not the CN; usable as a client certificate too, as the services present
theirs when they dial each other), and a client-only certificate. EC P-256 keys (quick to make),
valid for a day. Tests fail, naming the command that installs it, when openssl is not on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve.common.rpc import channel
from radixserve.common.tls import TLS

OPENSSL = "openssl"
_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class CertFiles:
    ca: str  # the CA's certificate (what peers trust)
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def require_openssl() -> str:
    path = shutil.which(OPENSSL)
    if path is None:
        pytest.fail("openssl is not on PATH: run scripts/test-deps (apt-get install openssl)", pytrace=False)
    return path


def _run(openssl: str, args: list[str]) -> None:
    r = subprocess.run([openssl, *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed ({r.returncode}): {r.stderr}")


def _signed(openssl: str, d: str, name: str, cn: str, ca: str, ca_key: str, ext: str) -> tuple[str, str]:
    """A key and a certificate for ``cn`` that the CA signed, with the extensions ``ext``."""
    key, csr, cert, ext_file = f"{d}/{name}.key", f"{d}/{name}.csr", f"{d}/{name}.pem", f"{d}/{name}.ext"
    with open(ext_file, "w") as f:
        f.write(
            "basicConstraints = critical, CA:FALSE\n"
            "keyUsage = critical, digitalSignature, keyEncipherment\n"
            "subjectKeyIdentifier = hash\n"
            "authorityKeyIdentifier = keyid, issuer\n" + ext
        )
    serial = str(int.from_bytes(os.urandom(8), "big"))
    _run(openssl, ["req", "-new", *_EC_KEY, "-keyout", key, "-out", csr, "-subj", f"/CN={cn}"])
    _run(
        openssl,
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-set_serial", serial]
        + ["-days", "1", "-sha256", "-extfile", ext_file, "-out", cert],
    )
    return cert, key


def make_certs(directory: str, openssl: str | None = None) -> CertFiles:
    """A fresh CA and the certificates it signed, as PEM files in ``directory``."""
    openssl = openssl or require_openssl()
    d = directory
    ca_key, ca = f"{d}/ca.key", f"{d}/ca.pem"
    _run(
        openssl,
        ["req", "-x509", *_EC_KEY, "-keyout", ca_key, "-out", ca, "-days", "1"]
        + ["-subj", "/CN=radixserve test CA", "-addext", "basicConstraints=critical,CA:TRUE"]
        + ["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
    )
    server_ext = "extendedKeyUsage = serverAuth, clientAuth\nsubjectAltName = IP:127.0.0.1, DNS:localhost\n"
    server_cert, server_key = _signed(openssl, d, "server", "localhost", ca, ca_key, server_ext)
    client_ext = "extendedKeyUsage = clientAuth\n"
    client_cert, client_key = _signed(openssl, d, "client", "radixserve test client", ca, ca_key, client_ext)
    return CertFiles(ca, server_cert, server_key, client_cert, client_key)


def check_code(address: str, tls: TLS | None) -> grpc.StatusCode:
    """The status of one health check (OK when served)."""
    with channel(address, tls) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK
