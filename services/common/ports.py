"""Free loopback ports, for processes started on this machine (``radixserve serve``, tensor-parallel
ranks' rendezvous, tests)."""

from __future__ import annotations

import socket


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
