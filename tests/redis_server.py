"""A real redis-server for tests: a foreground child process on a free loopback port.

    with RedisServer() as server:          # or the ``redis_server`` / ``redis_url`` fixtures below
        RedisPrefixIndex(server.url)
        server.stop()                      # the port goes dark (connections are refused)
        server.start()                     # back on the same port, EMPTY (no persistence)

The server runs in the foreground (``--daemonize no``) so it stays our child: we stop it by pid
(SIGTERM, wait, SIGKILL on timeout) and nothing outlives the test. Tests skip when redis-server is
not on PATH.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from radixserve.launcher import free_port

REDIS_SERVER = "redis-server"


def redis_server_path() -> str | None:
    return shutil.which(REDIS_SERVER)


def require_redis_server() -> str:
    path = redis_server_path()
    if path is None:
        pytest.skip("redis-server is not on PATH (install it: apt-get install redis-server)")
    return path


def _resp(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RedisServer:
    """One redis-server child. ``start`` after ``stop`` reuses the port (a restart: empty)."""

    def __init__(self, password: str | None = None, port: int | None = None) -> None:
        self.binary = require_redis_server()
        self.password = password
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="radixserve-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        assert not self.running, "already running"
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            self._dir.name,
            "--loglevel",
            "warning",
        ]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server on port {self.port} exited ({self.proc.returncode}): {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout_s} s")
            time.sleep(0.01)
        return self

    def ping(self) -> bool:
        """PING over a raw socket (independent of the redis client's retry policy)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                msg = (_resp("AUTH", self.password) if self.password else b"") + _resp("PING")
                s.sendall(msg)
                data = b""
                while b"PONG" not in data and len(data) < 4096:
                    chunk = s.recv(4096)
                    if not chunk:
                        return False
                    data += chunk
                    if data.startswith(b"-"):
                        return False
                return True
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if proc.stderr is not None:
            proc.stderr.close()

    def restart(self) -> RedisServer:
        """Stop and start again on the same port: the new server is empty."""
        self.stop()
        return self.start()

    def client(self, **kwargs: object):  # -> redis.Redis
        import redis

        return redis.Redis.from_url(self.url, decode_responses=True, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# To use them, import ``redis_server_fixture`` (and ``redis_url_fixture``) into the test module,
# with a noqa for F401, and take ``redis_server`` (``redis_url``) as an argument.
@pytest.fixture(name="redis_server")
def redis_server_fixture() -> Iterator[RedisServer]:
    """A fresh, running redis-server for one test: ``.url``, ``.stop()``, ``.start()`` (same port,
    empty), ``.restart()``, ``.client()``. Skips the test when redis-server is not on PATH."""
    with RedisServer() as server:
        yield server


@pytest.fixture(name="redis_url")
def redis_url_fixture(redis_server: RedisServer) -> str:
    return redis_server.url
