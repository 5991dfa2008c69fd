"""Weights streamed from s3:// or gs:// into memory, never onto the cache volume (``--load-format
stream``; the manifest fetch-model --skip-weights wrote names the objects: common/weight_manifest.py).

Each ``*.safetensors`` object is read with ranged GETs, ``PARTS_IN_FLIGHT`` of ``PART_BYTES`` at
once, into an anonymous memory file (``memfd_create``) of the object's size; the loader reads it as
any file, through ``/proc/self/fd/N`` (safetensors, pread). While one shard loads the next streams,
and a shard's memory is released once it is loaded: at most two shards are in host memory. The
headers come first, alone (a memory file of the shard's size holding only the header: the rest is
a hole, no memory), for the FP8 plan, which reads every header before anything loads.

A missing object, a store that cannot be reached or refuses the credentials, an object that changed
since the fetch (S3: If-Match on the listed ETag; GCS: the listed generation) or that ends early:
ModelSourceError, one line naming the object's URI; no partial model is served. A connection that
breaks mid-part is retried from where it broke, ``PART_ATTEMPTS`` times.

Linux only (memfd). gs:// goes through the same code with gcsfs's ranged reads
(tests/integration/test_model_source_gcs.py runs it against gcp-storage-emulator).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from radixserve.common.model_source import ModelSourceError, format_bytes, parse_model_uri
from radixserve.common.model_stores import ObjectStore, RemoteFile, StoreReadError, open_store
from radixserve.common.weight_manifest import StreamManifest
from radixserve.scheduler.model.weight_files import Shard, shard_names

log = logging.getLogger(__name__)

PARTS_IN_FLIGHT = 8
PART_BYTES = 32 << 20
PART_ATTEMPTS = 3
HEAD_BYTES = 256 << 10  # the first read of a header; a larger header costs one more


def fd_path(fd: int) -> Path:
    return Path(f"/proc/self/fd/{fd}")


@dataclass(slots=True)
class _Download:
    file: RemoteFile
    fd: int
    parts: list[Future[None]] = field(default_factory=list)


class StreamedWeights:
    """``names``: the shards the checkpoint is made of (weight_files.shard_names), each of which the
    manifest must list; ``store``: where they are (default: the manifest URI's store)."""

    mappable = False

    @classmethod
    def of(
        cls, folder: Path, parts_in_flight: int = PARTS_IN_FLIGHT, part_bytes: int = PART_BYTES
    ) -> StreamedWeights:
        """The stream of the shards ``folder``'s manifest lists (fetch-model --skip-weights wrote it)."""
        manifest = StreamManifest.read(folder)
        if manifest is None:
            raise ValueError(f"{folder}: no weight manifest (the model was not fetched with --skip-weights)")
        names = shard_names(folder, [f.rel for f in manifest.files])
        return cls(manifest, names, parts_in_flight=parts_in_flight, part_bytes=part_bytes)

    def __init__(
        self,
        manifest: StreamManifest,
        names: list[str],
        store: ObjectStore | None = None,
        parts_in_flight: int = PARTS_IN_FLIGHT,
        part_bytes: int = PART_BYTES,
    ) -> None:
        listed = {f.rel: f for f in manifest.files}
        missing = [n for n in names if n not in listed]
        if missing:
            raise ModelSourceError(
                f"{manifest.uri}/{missing[0]}: not in the store when the model was fetched (the "
                "safetensors index names it)"
            )
        if not hasattr(os, "memfd_create"):
            raise ModelSourceError(f"{manifest.uri}: streaming weights needs Linux (memfd_create)")
        self.uri = manifest.uri
        self.files = [listed[n] for n in names]
        self.store = store if store is not None else open_store(parse_model_uri(manifest.uri))
        self.part_bytes = part_bytes
        self.parts_in_flight = parts_in_flight
        self._pool = ThreadPoolExecutor(parts_in_flight, thread_name_prefix="weight-stream")
        self._abort = threading.Event()
        self._lock = threading.Lock()
        self._header_fds: list[int] = []
        self._active: list[_Download] = []  # shards in memory (the one loading, the one streaming)
        self.streamed_bytes = 0

    def headers(self) -> list[Path]:
        started = [self._pool.submit(self._header_file, f) for f in self.files]
        wait(started)
        self._header_fds = [f.result() for f in started if f.exception() is None]
        for f in started:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [fd_path(fd) for fd in self._header_fds]

    def shards(self) -> Iterator[Shard]:
        self._close_headers()  # the plan has read them
        t0 = time.monotonic()
        for i, file in enumerate(self.files):
            if i == 0:
                self._active.append(self._start(file))
            current = self._active[0]
            self._finish(current)
            if i + 1 < len(self.files):
                self._active.append(self._start(self.files[i + 1]))  # streams while this one loads
            yield Shard(fd_path(current.fd), file.rel)
            self._active.remove(current)
            os.close(current.fd)  # its memory goes back
        seconds = time.monotonic() - t0
        log.info(
            "weights: streamed %d files, %s from %s in %.1f s (%.0f MiB/s, loading included; up to %d"
            " ranged reads of %s in flight)",
            len(self.files), format_bytes(self.streamed_bytes), self.uri, seconds,
            self.streamed_bytes / 2**20 / max(seconds, 1e-9), self.parts_in_flight,
            format_bytes(self.part_bytes),
        )  # fmt: skip

    def close(self) -> None:
        """Stop what still streams and release every memory file (also after a failure)."""
        self._abort.set()
        for d in self._active:
            for part in d.parts:
                part.cancel()
            wait(d.parts)  # no write may reach a descriptor number that is reused
            os.close(d.fd)
        self._active = []
        self._close_headers()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------------------ internals
    def _start(self, file: RemoteFile) -> _Download:
        fd = _memory_file(file.rel, file.size)
        d = _Download(file, fd)
        for start in range(0, file.size, self.part_bytes):
            stop = min(start + self.part_bytes, file.size)
            d.parts.append(self._pool.submit(self._part, file, fd, start, stop))
        return d

    def _finish(self, d: _Download) -> None:
        """Wait for ``d``'s parts; the first failure raises (the others stop first)."""
        for part in d.parts:
            if part.exception() is not None:
                self._abort.set()
                wait(d.parts)
                raise part.exception()  # type: ignore[misc]

    def _part(self, file: RemoteFile, fd: int, start: int, stop: int) -> None:
        def write(at: int, view: memoryview) -> None:
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
                with self._lock:
                    self.streamed_bytes += n

        self._read(file, start, stop, write)

    def _header_file(self, file: RemoteFile) -> int:
        """A memory file of ``file``'s size that holds its safetensors header (and only that)."""
        head = bytearray(min(file.size, HEAD_BYTES))

        def keep(at: int, view: memoryview) -> None:
            head[at : at + len(view)] = view

        self._read(file, 0, len(head), keep)
        (n,) = struct.unpack("<Q", head[:8]) if len(head) >= 8 else (file.size,)
        if 8 + n > file.size:
            raise ModelSourceError(f"{self.uri}/{file.rel}: not a safetensors file (no header)")
        if 8 + n > len(head):  # a long header: the rest of it
            first = len(head)
            head.extend(bytes(8 + n - first))
            self._read(file, first, 8 + n, keep)
        fd = _memory_file(f"{file.rel} header", file.size)
        os.pwrite(fd, head[: 8 + n], 0)
        return fd

    def _read(
        self, file: RemoteFile, start: int, stop: int, write: Callable[[int, memoryview], None]
    ) -> None:
        """Bytes ``start:stop`` of ``file`` to ``write(offset, bytes)`` as they arrive; a connection
        that breaks is read on from where it broke (``PART_ATTEMPTS`` tries in all)."""
        at = start
        for attempt in range(1, PART_ATTEMPTS + 1):
            try:
                for chunk in self.store.read(file, at, stop):
                    if self._abort.is_set():
                        return
                    view = memoryview(chunk)[: stop - at]
                    write(at, view)
                    at += len(view)
                break
            except StoreReadError as e:
                if attempt == PART_ATTEMPTS or self._abort.is_set():
                    raise
                log.warning("weights: %s (at byte %d); try %d of %d", e, at, attempt + 1, PART_ATTEMPTS)
        if at != stop:
            raise ModelSourceError(
                f"{self.uri}/{file.rel}: the object ended at byte {at}, the listing said {file.size} "
                "bytes (truncated since the model was fetched)"
            )

    def _close_headers(self) -> None:
        for fd in self._header_fds:
            os.close(fd)
        self._header_fds = []


def _memory_file(name: str, size: int) -> int:
    fd = os.memfd_create(name.replace("/", "_"))
    os.ftruncate(fd, size)  # a hole: memory is taken as the parts are written
    return fd
