"""A real Google Cloud Storage server for tests: gcp-storage-emulator (the JSON API over real HTTP,
in memory) as a child process on a free loopback port, stopped by its pid, and a client for it.

The code under test finds it through ``STORAGE_EMULATOR_HOST`` (gcsfs and Google's libraries
honour it, and then use no credentials)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from radixserve.common.model_source import tree_files
from radixserve.common.ports import free_port

BUCKET = "models"


@contextlib.contextmanager
def gcs_emulator() -> Iterator[str]:
    """The emulator's URL (what ``STORAGE_EMULATOR_HOST`` is set to) while it runs."""
    port = free_port()
    cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--in-memory", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/", timeout=1).close()  # its health check answers "OK"
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"gcp-storage-emulator did not start on {url}") from None
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


def gcs_client(url: str) -> Any:
    """gcsfs's core filesystem on the emulator, anonymous (what GcsStore uses with an emulator)."""
    import gcsfs

    return gcsfs.core.GCSFileSystem(token="anon", endpoint_url=url, skip_instance_cache=True)


def upload(fs: Any, folder: Path, prefix: str, bucket: str = BUCKET) -> None:
    for rel in tree_files(folder):
        fs.pipe_file(f"{bucket}/{prefix}/{rel}", (folder / rel).read_bytes())
