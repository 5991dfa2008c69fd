"""A real S3 server for tests: moto in server mode (real HTTP on a free loopback port, a child
process stopped by its pid), its credentials, and uploading a model folder to it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixserve.common.model_source import tree_files
from tests.helpers.local_server import local_server

BUCKET = "models"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """The server's URL while it runs."""

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

    with local_server("moto server", command, "/moto-api/") as url:
        yield url


def client_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_REGION"],
    }


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, **client_credentials())


def upload(client: Any, folder: Path, prefix: str, bucket: str = BUCKET) -> None:
    for rel in tree_files(folder):
        client.upload_file(str(folder / rel), bucket, f"{prefix}/{rel}")


class CuttingProxy:
    """A TCP proxy to ``target`` (host, port) that breaks connections mid-answer: a connection that
    has carried ``cut_after`` bytes back to the client is reset, ``cuts`` times in all (then it
    relays faithfully). What a load balancer restarting or a flaky network does to a long GET."""

    def __init__(self, target: tuple[str, int], cut_after: int, cuts: int) -> None:
        import socket
        import threading

        self.target, self.cut_after, self.cuts = target, cut_after, cuts
        self.cut = 0  # connections broken so far
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: Any) -> None:
        import socket
        import threading

        upstream = socket.create_connection(self.target)

        def forward() -> None:
            with contextlib.suppress(OSError):
                while data := client.recv(1 << 16):
                    upstream.sendall(data)
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)

        threading.Thread(target=forward, daemon=True).start()
        carried = 0
        with contextlib.suppress(OSError):
            while data := upstream.recv(1 << 16):
                with self._lock:
                    cut = self.cut < self.cuts and carried + len(data) > self.cut_after
                    self.cut += cut
                if cut:
                    client.sendall(data[: self.cut_after - carried])
                    client.shutdown(
                        socket.SHUT_RDWR
                    )  # closed mid-answer (close alone waits for forward's recv)
                    break
                client.sendall(data)
                carried += len(data)
        client.close()
        upstream.close()


# Fixtures the S3 tests share, named apart so modules can import them (as tests/helpers/prefix_index.py's)
@pytest.fixture(scope="module", name="s3_endpoint")
def s3_endpoint_fixture() -> Iterator[str]:
    """A moto S3 server in server mode: real HTTP, a child process we stop by pid."""
    pytest.importorskip("moto.server", reason="pip install 'moto[server]'")
    with moto_server() as url:
        yield url


@pytest.fixture(name="s3_env")
def s3_env_fixture(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The credentials Secret's variables, for this process and the fetchers it starts."""
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
