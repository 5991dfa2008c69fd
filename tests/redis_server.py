"""A real redis-server for tests: a foreground child process on a free loopback port.

    with RedisServer() as server:          # or the ``redis_server`` / ``redis_url`` fixtures below
        RedisPrefixIndex(server.url)
        server.stop()                      # the port goes dark (connections are refused)
        server.start()                     # back on the same port, EMPTY (no persistence)

    with RedisServer(password="pw", tls=True) as server:   # TLS only (no plain port)
        server.url      # rediss://:pw@127.0.0.1:PORT/0?ssl_ca_certs=/tmp/.../ca.pem
        server.ca_file  # the throwaway CA that signed the server's certificate

    with RedisServer(password="admin", maxmemory="2mb", maxmemory_policy="volatile-lru") as server:
        server.add_user("svc-a", "pw-a", ["~a:*", "+get"])   # ACL SETUSER over the admin connection
        server.url_for("svc-a", "pw-a")                     # redis://svc-a:pw-a@127.0.0.1:PORT/0

With ``tls=True`` a throwaway CA and a server certificate for 127.0.0.1 / localhost (both in the
subject alternative names) are made with the openssl CLI in the server's temporary directory;
clients need not present a certificate (``--tls-auth-clients no``).

The server runs in the foreground (``--daemonize no``) so it stays our child: we stop it by pid
(SIGTERM, wait, SIGKILL on timeout) and nothing outlives the test. Tests fail, naming the command
that installs it (scripts/test-deps), when redis-server is not on PATH (or, for ``tls=True``,
openssl is not).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from radixserve.launcher import free_port
from tests.certs import OPENSSL, make_certs, require_openssl

REDIS_SERVER = "redis-server"


def redis_server_path() -> str | None:
    return shutil.which(REDIS_SERVER)


def require_redis_server() -> str:
    path = redis_server_path()
    if path is None:
        pytest.fail(
            "redis-server is not on PATH: run scripts/test-deps (apt-get install redis-server)", pytrace=False
        )
    return path


def make_test_certs(directory: str, openssl: str = OPENSSL) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate it signed, valid for 127.0.0.1 and localhost (see
    tests/certs.py). Returns the paths of (CA certificate, server certificate, server key)."""
    certs = make_certs(directory, openssl)
    return certs.ca, certs.server_cert, certs.server_key


def _resp(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RedisServer:
    """One redis-server child. ``start`` after ``stop`` reuses the port (a restart: empty).

    ``tls=True``: TLS only, on ``port`` (the plain port is off); ``url`` is then a rediss:// URL
    that carries the CA (``?ssl_ca_certs=``), and ``ca_file`` is that CA."""

    def __init__(
        self,
        password: str | None = None,
        port: int | None = None,
        tls: bool = False,
        maxmemory: str | None = None,
        maxmemory_policy: str | None = None,
    ) -> None:
        self.binary = require_redis_server()
        self.password = password
        self.tls = tls
        self.maxmemory = maxmemory  # e.g. "2mb" (redis-server's --maxmemory)
        self.maxmemory_policy = maxmemory_policy  # e.g. "volatile-lru"
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.proc: subprocess.Popen[bytes] | None = None
        self.last_ping_error: OSError | None = None  # why the last failed ping failed
        self._dir = tempfile.TemporaryDirectory(prefix="radixserve-redis-")
        self.ca_file: str | None = None
        self.cert_file: str | None = None
        self.key_file: str | None = None
        if tls:
            self.ca_file, self.cert_file, self.key_file = make_test_certs(self._dir.name, require_openssl())

    @property
    def url(self) -> str:
        """The admin's URL (the default user, with ``password``)."""
        return self.url_for(None, self.password)

    def url_for(self, user: str | None, password: str | None) -> str:
        """A URL that logs in as ``user`` (None: the default user) with ``password``."""
        auth = f"{quote(user or '', safe='')}:{quote(password, safe='')}@" if password else ""
        if self.tls:
            assert self.ca_file is not None
            return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={quote(self.ca_file)}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        assert not self.running, "already running"
        cmd = [
            self.binary,
            "--port",
            "0" if self.tls else str(self.port),
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
        if self.maxmemory:
            cmd += ["--maxmemory", self.maxmemory]
        if self.maxmemory_policy:
            cmd += ["--maxmemory-policy", self.maxmemory_policy]
        if self.tls:
            assert self.ca_file and self.cert_file and self.key_file
            cmd += [
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                self.cert_file,
                "--tls-key-file",
                self.key_file,
                "--tls-ca-cert-file",
                self.ca_file,
                "--tls-auth-clients",
                "no",
            ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server on port {self.port} exited ({self.proc.returncode}): {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"redis-server on port {self.port} did not answer PING in {timeout_s} s"
                    f" (last error: {self.last_ping_error!r})"
                )
            time.sleep(0.01)
        return self

    def ping(self) -> bool:
        """PING over a raw socket (independent of the redis client's retry policy); with TLS, over
        a TLS socket that checks the server's certificate against ``ca_file`` and 127.0.0.1."""
        try:
            with contextlib.ExitStack() as stack:
                s = stack.enter_context(socket.create_connection((self.host, self.port), timeout=0.5))
                if self.tls:
                    ctx = ssl.create_default_context(cafile=self.ca_file)
                    s = stack.enter_context(ctx.wrap_socket(s, server_hostname=self.host))
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
        except OSError as e:  # ssl.SSLError included
            self.last_ping_error = e
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

    def add_user(self, name: str, password: str, rules: list[str]) -> None:
        """Create (or reset) the ACL user ``name`` with ``password`` and ``rules`` (ACL SETUSER's),
        over the admin connection. Users live in memory: a restart (``start`` after ``stop``)
        forgets them."""
        admin = self.client()
        try:
            admin.execute_command("ACL", "SETUSER", name, "reset", f">{password}", *rules)
        finally:
            admin.close()

    def acl_log(self) -> list[dict[str, object]]:
        """The server's ACL LOG (what it refused, newest first)."""
        admin = self.client()
        try:
            return list(admin.acl_log())
        finally:
            admin.close()

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
