"""A real Google Cloud Storage server for tests: gcp-storage-emulator (the JSON API over real HTTP,
in memory) as a child process on a free loopback port, stopped by its pid, and a client for it.

The code under test finds it through ``STORAGE_EMULATOR_HOST`` (gcsfs and Google's libraries
honour it, and then use no credentials)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from radixserve.common.model_source import tree_files
from tests.helpers.local_server import local_server

BUCKET = "models"


@contextlib.contextmanager
def gcs_emulator() -> Iterator[str]:
    """The emulator's URL (what ``STORAGE_EMULATOR_HOST`` is set to) while it runs."""

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1"]
        return [*cmd, "--port", str(port), "--in-memory", "--quiet"]

    with local_server("gcp-storage-emulator", command, "/") as url:  # its health check answers "OK"
        yield url


def gcs_client(url: str) -> Any:
    """gcsfs's core filesystem on the emulator, anonymous (what GcsStore uses with an emulator)."""
    import gcsfs

    return gcsfs.core.GCSFileSystem(token="anon", endpoint_url=url, skip_instance_cache=True)


def upload(fs: Any, folder: Path, prefix: str, bucket: str = BUCKET) -> None:
    for rel in tree_files(folder):
        fs.pipe_file(f"{bucket}/{prefix}/{rel}", (folder / rel).read_bytes())
