"""write_atomic: a file written whole or not at all (a temp file in its directory, then a rename), for
readers that must never see half of one: the disk KV tier's blocks (scheduler/memory/disk_store.py)
and the model cache's ``.complete`` marker (common/model_cache.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path

TEMP_PREFIX = ".tmp-"  # a crashed writer's leftovers start with it (the disk tier sweeps its own)


def write_atomic(path: Path, parts: Iterable[bytes | memoryview], fsync: bool = False) -> None:
    """``path`` holds ``parts`` (written one after the other) whole, or is as it was. ``fsync``: the
    data is on disk before the rename (a crash then never leaves ``path`` empty or short)."""
    tmp = path.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
