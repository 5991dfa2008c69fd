"""The three services with mutual TLS on every gRPC port and channel (the RADIXSERVE_TLS_* variables,
as a pod gets them from a Secret): a completion end to end over HTTP, gRPC Generate with a client
certificate, and the ports refusing clients without one or without TLS."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import grpc
import httpx
import pytest

from radixserve.common.ports import free_ports
from radixserve.common.rpc import channel, pb, pb_grpc
from radixserve.common.tls import TLS
from radixserve.launcher import Cluster
from tests.certs import CertFiles, check_code, make_certs
from tests.helpers.cluster import MODEL_NAME, start_cluster


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def tls_cluster(model_dir, certs: CertFiles) -> Iterator[Cluster]:
    env = {
        "RADIXSERVE_TLS_CERT": certs.server_cert,
        "RADIXSERVE_TLS_KEY": certs.server_key,
        "RADIXSERVE_TLS_CA": certs.ca,
        "RADIXSERVE_TLS_CLIENT_AUTH": "true",
    }
    c = start_cluster(model_dir, schedulers=1, env=env)  # ready: the launcher's probes speak TLS too
    yield c
    c.stop(drain_timeout=5)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_completion_over_mutual_tls(tls_cluster):
    body = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{tls_cluster.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 8


def test_grpc_generate_with_a_client_certificate(tls_cluster, certs):
    tls = TLS(read(certs.ca), read(certs.client_cert), read(certs.client_key))
    with channel(tls_cluster.grpc_address, tls) as ch:
        req = pb.GenerateRequest(
            model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(max_new_tokens=4, temperature=0)
        )
        msgs = list(pb_grpc.GatewayStub(ch).Generate(req, timeout=60))
    assert msgs[-1].usage.completion_tokens == 4


def test_ports_refuse_plaintext_and_clients_without_a_certificate(tls_cluster, certs):
    with_cert = TLS(read(certs.ca), read(certs.client_cert), read(certs.client_key))
    without = TLS(read(certs.ca))
    ports = [s.grpc_address or "" for s in (*tls_cluster.schedulers, tls_cluster.detokenizer)]
    for address in [*ports, tls_cluster.grpc_address]:
        assert check_code(address, with_cert) == grpc.StatusCode.OK, address
        assert check_code(address, None) == grpc.StatusCode.UNAVAILABLE, address
        assert check_code(address, without) == grpc.StatusCode.UNAVAILABLE, address
    # nor does a plaintext call of the Scheduler service
    address = tls_cluster.schedulers[0].grpc_address or ""
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.SchedulerStub(ch).GetLoad(pb.LoadRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


REQUIRED_FLAGS = {
    "scheduler": ["--detokenizer", "127.0.0.1:1", "--metrics-port", "0"],
    "detokenizer": ["--metrics-port", "0"],
    "tokenizer": ["--schedulers", "127.0.0.1:1", "--grpc-port"],  # + a free port
}


@pytest.mark.parametrize("service", sorted(REQUIRED_FLAGS))
def test_a_service_with_half_the_tls_settings_does_not_start(service, model_dir, certs):
    port, grpc_port = free_ports(2)  # ports are 1-65535; these are free, though none gets that far
    argv = [sys.executable, "-m", f"radixserve.{service}", "--model", str(model_dir), "--port", str(port)]
    argv += REQUIRED_FLAGS[service] + ([str(grpc_port)] if service == "tokenizer" else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_TLS_")}
    env["RADIXSERVE_TLS_CERT"] = certs.server_cert  # no key, no CA
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "TLS needs --tls-cert, --tls-key and --tls-ca together" in r.stderr
    assert "--tls-key (RADIXSERVE_TLS_KEY)" in r.stderr
