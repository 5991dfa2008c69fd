"""Where the loader's ``*.safetensors`` come from: the model folder (``LocalWeights``, today's cache
and every local model), or the object store the folder's manifest names (``StreamedWeights``,
model/weight_stream.py: ``--load-format stream``). The loader reads either the same way, as files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from radixserve.common.weight_manifest import MANIFEST


@dataclass(frozen=True, slots=True)
class Shard:
    """A weight file the loader may read whole: ``path`` (a file, or a memory file's /proc/self/fd
    path) and ``name``, its name in the model (what messages say)."""

    path: Path
    name: str


class WeightFiles(Protocol):
    """The checkpoint's files: ``headers()`` first (files whose safetensors headers may be read: the
    FP8 plan reads every one before anything loads), then ``shards()``, each valid until the next is
    asked for, then ``close()``. ``mappable``: whether a shard may outlive its turn as a mapping of
    the model's parameters (a file's page cache may; a streamed shard's memory is released)."""

    mappable: bool

    def headers(self) -> list[Path]: ...

    def shards(self) -> Iterator[Shard]: ...

    def close(self) -> None: ...


def shard_names(folder: Path, available: list[str]) -> list[str]:
    """The ``*.safetensors`` (names in the folder, from ``available``) that make up the checkpoint:
    those the sharded index names, else model.safetensors, else all of them."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if "model.safetensors" in available:
        return ["model.safetensors"]
    found = sorted(n for n in available if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return found


def safetensor_files(path: Path) -> list[Path]:
    return [path / name for name in shard_names(path, [p.name for p in path.glob("*.safetensors")])]


class LocalWeights:
    """The folder's own files."""

    mappable = True

    def __init__(self, folder: Path) -> None:
        self.files = safetensor_files(folder)

    def headers(self) -> list[Path]:
        return self.files

    def shards(self) -> Iterator[Shard]:
        return (Shard(f, f.name) for f in self.files)

    def close(self) -> None:
        pass


def open_weights(folder: Path) -> WeightFiles:
    """The weights of the model in ``folder``: streamed where the folder was fetched without them (a
    manifest), else its files. (Whether ``--load-format`` allows this folder the engine checks first:
    config.load_format_problem.)"""
    if not (folder / MANIFEST).is_file():
        return LocalWeights(folder)
    from radixserve.scheduler.model.weight_stream import StreamedWeights

    return StreamedWeights.of(folder)
