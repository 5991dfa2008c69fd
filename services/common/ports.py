"""Free loopback ports, for processes started on this machine (``radixserve serve``, tensor-parallel
ranks' rendezvous, tests), and whether a service's own ports can be listened on before it starts
(a port in use is one line at once, not a bind error after the model has loaded)."""

from __future__ import annotations

import errno
import socket

from radixserve.common.config import ConfigError


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all held open at once, so the kernel cannot hand one out twice."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def listen_problem(host: str, port: int) -> str | None:
    """Why nothing could listen on ``host:port`` now (the port is taken, the address is not this
    machine's), None if it could. Bound as the servers bind (SO_REUSEADDR: a port a stopped server
    left in TIME_WAIT is free to them) and released at once: a check, not a reservation."""
    bare = host.strip("[]") or None  # "" and "[::]" as gRPC and uvicorn take them
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        return f"{host}: not an address to listen on ({e})"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"{host or '0.0.0.0'}:{port} is in use (another process holds it)"
            return f"cannot listen on {host or '0.0.0.0'}:{port}: {e.strerror or e}"
    return None


def check_listen(host: str, ports: dict[str, int]) -> None:
    """ConfigError naming ``--host`` when it is no address here, else the first of ``ports`` (by
    flag; 0: off) nothing could listen on at ``host``."""
    try:
        socket.getaddrinfo(host.strip("[]") or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {host}: not an address to listen on ({e})") from None
    for flag, port in ports.items():
        if port and (problem := listen_problem(host, port)) is not None:
            raise ConfigError(f"{flag} {port}: {problem}")
