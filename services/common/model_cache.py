"""The model cache: one folder (a shared PVC, a node's hostPath or a pod's emptyDir) holding downloaded
models, bounded by a size limit, safe for several fetchers at once.

    <root>/<entry>/<name>/        the model folder (entry: ModelSource.entry(), name: ModelSource.name)
    <root>/<entry>/.complete      written last, atomically: the EntryRecord (JSON); its mtime is the
                                  entry's last use
    <root>/.locks/<entry>.lock    held (flock) while the entry is checked or downloaded
    <root>/.locks/cache.lock      held while sizes are added up and entries evicted

A fetcher takes its entry's lock, then either finds ``.complete`` (a hit: no download, the stamp is
touched) or downloads into a fresh entry and writes ``.complete`` last, so a crash mid-download
leaves an entry without it, which the next fetcher redoes (or eviction removes). Eviction drops the
least recently used complete entries, and stale partial ones, whose lock nobody holds, until the
entries fit the limit. An entry that running pods read may be evicted when the cache is full (a new
pod of that service downloads it again); size the limit for the models in use.

Locks are ``flock``: on NFS (most ReadWriteMany volumes) Linux turns them into byte-range locks the
server coordinates, so fetchers on different nodes exclude each other too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from radixserve.common.atomic_file import write_atomic
from radixserve.common.model_source import ModelSource, ModelSourceError, format_bytes

MARKER = ".complete"
# Compiled kernels (flashinfer's JIT, Triton, Inductor) kept beside the models, so a scheduler that
# starts again on the cache compiles nothing; a dot folder, so never an entry the size limit evicts.
COMPILED = ".compiled"
LOCKS = ".locks"


@dataclass(frozen=True, slots=True)
class EntryRecord:
    """What ``.complete`` holds: where the files came from and what they are."""

    uri: str
    digest: str  # model_source.tree_digest of the model folder
    size: int  # bytes
    files: int
    revision: str = ""  # hf: the commit the revision resolved to
    etags: dict[str, str] = field(default_factory=dict)  # s3/gs: each object's ETag / generation
    fetched_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EntryRecord:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    size: int
    last_used: float  # 0: incomplete
    complete: bool


class ModelCache:
    """``root``: the cache folder (created if missing); ``size_limit``: bytes its entries may hold;
    ``log``: one line per step worth telling (waiting for a lock, evicting)."""

    def __init__(self, root: Path, size_limit: int, log: Callable[[str], None] = lambda _: None) -> None:
        self.root = root
        self.size_limit = size_limit
        self.log = log
        try:
            (root / LOCKS).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ModelSourceError(
                f"cannot write to the model cache {root}: {e.strerror} (the pods run as uid 1000)"
            ) from e

    def model_dir(self, source: ModelSource) -> Path:
        return self.root / source.relative_model_dir()

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold ``name``'s lock (an entry, or ``cache`` for the whole); says so when it must wait."""
        with open(self.root / LOCKS / f"{name}.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                self.log(f"waiting for another fetcher of cache entry {name} (lock {f.name})")
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _try_lock(self, name: str) -> Iterator[bool]:
        """Hold ``name``'s lock if nobody else does (yields whether it does): eviction takes an
        entry's lock so that no fetcher finds it complete while it is being removed."""
        with open(self.root / LOCKS / f"{name}.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def record(self, source: ModelSource) -> EntryRecord | None:
        """The complete entry's record for ``source`` (hold its lock), or None when there is none."""
        marker = self.root / source.entry() / MARKER
        try:
            record = EntryRecord.from_json(marker.read_text())
        except (OSError, ValueError, TypeError):
            return None
        if record.uri != source.uri or not self.model_dir(source).is_dir():
            return None  # a 64-bit key collision, or a folder removed by hand
        return record

    def touch(self, source: ModelSource) -> None:
        """Mark ``source``'s entry used now (least-recently-used eviction reads this)."""
        os.utime(self.root / source.entry() / MARKER)

    def begin(self, source: ModelSource) -> Path:
        """An empty model folder for ``source`` (anything left there before is removed); hold its lock."""
        self.discard(source)
        path = self.model_dir(source)
        path.mkdir(parents=True)
        return path

    def finish(self, source: ModelSource, record: EntryRecord) -> None:
        """Mark ``source``'s entry complete: its record, written to a temporary file then renamed."""
        write_atomic(self.root / source.entry() / MARKER, [record.to_json().encode()], fsync=True)

    def discard(self, source: ModelSource) -> None:
        """Remove ``source``'s entry (hold its lock): the marker first, so it is never complete half gone."""
        self._remove(source.entry())

    def _remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / name / MARKER).unlink()
        shutil.rmtree(self.root / name, ignore_errors=True)

    def make_room(self, need: int, keep: ModelSource) -> None:
        """Evict until ``need`` more bytes fit beside ``keep``'s entry (whose own size counts too
        when it is complete); ModelSourceError when they cannot."""
        if need > self.size_limit:
            raise ModelSourceError(
                f"{keep.uri} is {format_bytes(need)}, more than the model cache's size limit "
                f"{format_bytes(self.size_limit)} (raise spec.model.cache.sizeLimit)"
            )
        with self.lock("cache"):
            entries = self._entries()
            used = sum(e.size for e in entries)
            # Partial entries nobody is writing first (a crashed fetch), then the least recently used.
            for e in sorted(entries, key=lambda e: (e.complete, e.last_used)):
                if used + need <= self.size_limit:
                    return
                if e.name == keep.entry():
                    continue
                with self._try_lock(e.name) as held:
                    if not held:  # being downloaded (or checked) right now
                        continue
                    self.log(f"evicting cache entry {e.name} ({format_bytes(e.size)}) to make room")
                    self._remove(e.name)
                used -= e.size
            if used + need > self.size_limit:
                raise ModelSourceError(
                    f"{keep.uri}: the model cache {self.root} cannot make room for {format_bytes(need)}: "
                    f"{format_bytes(used)} of its {format_bytes(self.size_limit)} limit is in entries "
                    "being downloaded or needed now"
                )

    def usage(self) -> int:
        """Bytes the entries hold."""
        return sum(e.size for e in self._entries())

    def _entries(self) -> list[_Entry]:
        out = []
        for path in self.root.iterdir():
            if path.name.startswith(".") or not path.is_dir():
                continue
            marker = path / MARKER
            try:
                record = EntryRecord.from_json(marker.read_text())
                out.append(_Entry(path.name, record.size, marker.stat().st_mtime, True))
            except (OSError, ValueError, TypeError):
                out.append(_Entry(path.name, folder_size(path), 0.0, False))
        return out


def folder_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (what a size limit counts)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we walk: it no longer counts
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
