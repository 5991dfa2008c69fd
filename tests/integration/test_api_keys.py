"""API keys at the front door, through real processes: the openai SDK and httpx over HTTP, gRPC
Generate; keys from --api-key, --api-key-file and RADIXSERVE_API_KEY; /health always open,
/metrics open unless --protect-metrics; a key file that cannot be read stops the gateway's start."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from radixserve.common.rpc import pb, pb_grpc
from radixserve.launcher import Cluster
from tests.helpers.cluster import MODEL_NAME, start_cluster

FLAG_KEY, FILE_KEY, ENV_KEY = "sk-flag-0123456789", "sk-file-abcdef", "sk-env-987654"


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory) -> Iterator[Cluster]:
    """One scheduler behind a gateway with a key on the command line and one in a file."""
    f = tmp_path_factory.mktemp("secret") / "api-keys"
    f.write_text(f"# mounted from a Secret\n{FILE_KEY}\n\n")
    c = start_cluster(model_dir, schedulers=1, gateway_args=["--api-key", FLAG_KEY, "--api-key-file", str(f)])
    yield c
    c.stop(drain_timeout=5)


def sdk(cluster: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=0)


def complete(cluster: Cluster, key: str) -> str:
    r = sdk(cluster, key).completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=4)
    return r.choices[0].text


# ----------------------------------------------------------------------------------------- HTTP
def test_the_openai_sdk_needs_a_right_key(keyed):
    with pytest.raises(openai.AuthenticationError) as e:
        complete(keyed, "sk-wrong")
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        sdk(keyed, FLAG_KEY[:-1]).models.list()  # a prefix of a right key is a wrong one
    assert complete(keyed, FLAG_KEY)
    assert complete(keyed, FILE_KEY)  # --api-key-file's keys count as well
    chat = sdk(keyed, FILE_KEY).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert [ch for ch in chat if ch.choices]
    assert [m.id for m in sdk(keyed, FLAG_KEY).models.list().data] == [MODEL_NAME]


def test_no_key_is_a_401_with_openais_error_body(keyed):
    for method, path in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    ]:
        r = httpx.request(method, f"{keyed.url}{path}", json={"model": MODEL_NAME, "prompt": "hi"})
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "invalid_api_key",
            None,
        )
        assert "Authorization: Bearer" in error["message"]
    # x-api-key works too; a wrong one, or one in another scheme, does not
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    assert (
        httpx.post(f"{keyed.url}/v1/completions", json=body, headers={"x-api-key": FILE_KEY}).status_code
        == 200
    )
    for headers in ({"x-api-key": "nope"}, {"authorization": f"Basic {FLAG_KEY}"}):
        assert httpx.post(f"{keyed.url}/v1/completions", json=body, headers=headers).status_code == 401
    # a refusal comes before the body is read: a body declared oversized is a 401, not a 413
    host, port = keyed.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 9437184\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 401 ")


def test_health_and_metrics_are_open_by_default(keyed):
    health = httpx.get(f"{keyed.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    httpx.get(f"{keyed.url}/v1/models", headers={"authorization": "Bearer nope"})
    httpx.get(f"{keyed.url}/made-up-path")
    metrics = httpx.get(f"{keyed.url}/metrics")
    assert metrics.status_code == 200
    assert 'radixserve_requests_total{endpoint="/v1/models",status="401"}' in metrics.text
    assert 'endpoint="other",status="401"' in metrics.text  # made-up paths are no labels of their own
    assert "made-up-path" not in metrics.text


# ----------------------------------------------------------------------------------------- gRPC
def generate(cluster: Cluster, metadata: list[tuple[str, str]] | None) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(model=MODEL_NAME, text="hi", sampling=pb.SamplingParams(max_new_tokens=3))
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        return list(pb_grpc.GatewayStub(ch).Generate(req, metadata=metadata, timeout=60))


def test_grpc_generate_needs_a_right_key(keyed):
    for metadata, says in [
        (None, "no API key"),
        ([("authorization", "Bearer sk-wrong")], "incorrect API key"),
        ([("authorization", FLAG_KEY)], "no API key"),  # no scheme
    ]:
        with pytest.raises(grpc.RpcError) as e:
            generate(keyed, metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert says in (e.value.details() or "")
    for key in (FLAG_KEY, FILE_KEY):
        msgs = generate(keyed, [("authorization", f"Bearer {key}")])
        assert msgs[-1].finish_reason and msgs[-1].usage.completion_tokens == 3


def test_grpc_health_needs_no_key(keyed):
    from radixserve.common.health import is_serving

    assert is_serving(keyed.grpc_address)


# ---------------------------------------------------------------------- --protect-metrics, env
def test_protect_metrics_and_a_key_from_the_environment(model_dir):
    c = start_cluster(
        model_dir, schedulers=1, gateway_args=["--protect-metrics"], env={"RADIXSERVE_API_KEY": ENV_KEY}
    )
    try:
        assert httpx.get(f"{c.url}/health").status_code == 200
        r = httpx.get(f"{c.url}/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(f"{c.url}/metrics", headers={"authorization": f"Bearer {ENV_KEY}"})
        assert r.status_code == 200 and 'endpoint="/metrics",status="401"' in r.text
        assert complete(c, ENV_KEY)
        with pytest.raises(openai.AuthenticationError):
            complete(c, FLAG_KEY)
    finally:
        c.stop(drain_timeout=5)


def test_a_key_file_that_cannot_be_read_stops_the_start(model_dir, tmp_path):
    missing = tmp_path / "no-such-secret"
    empty = tmp_path / "empty-secret"
    empty.write_text("# the Secret had no keys\n")
    for path, says in [(missing, "cannot read it"), (empty, "no key in it")]:
        argv = ["--model", str(model_dir), "--schedulers", "127.0.0.1:1", "--api-key-file", str(path)]
        p = subprocess.run(
            [sys.executable, "-m", "radixserve.tokenizer", *argv], capture_output=True, text=True, timeout=120
        )
        assert p.returncode != 0
        assert f"--api-key-file {path}: {says}" in p.stderr
