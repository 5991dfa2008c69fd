"""A server for tests as a child process on a free loopback port: started, waited for until its
health URL answers, stopped by its pid (the object stores' servers: tests/helpers/s3.py, gcs.py)."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator

from radixserve.common.ports import free_port


@contextlib.contextmanager
def local_server(name: str, command: Callable[[int], list[str]], health_path: str) -> Iterator[str]:
    """``command(port)`` running; yields its URL once ``health_path`` answers (30 s at most)."""
    port = free_port()
    proc = subprocess.Popen(command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + health_path, timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{name} did not start on {url}") from None
            time.sleep(0.1)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
