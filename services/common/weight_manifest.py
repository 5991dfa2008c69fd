"""The weights a model folder leaves in its store: ``fetch-model --skip-weights`` fetches an s3:// or
gs:// model's small files (config.json, the tokenizer's, the safetensors index) and writes, in
their place, this manifest of the ``*.safetensors`` objects, which the scheduler streams at load
(``--load-format stream``: scheduler/model/weight_stream.py) instead of reading them from the cache
volume. The manifest records each object's size and ETag (GCS: generation) as listed, so the stream
reads the very objects the fetch saw (a replaced object is an error, not half of each version).

Weights in formats radixserve does not load (``*.bin``, ``*.pth``, ``*.gguf``...: a Hub folder's
``original/`` copy, say) are not fetched at all by --skip-weights.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from radixserve.common.model_stores import RemoteFile

MANIFEST = "radixserve-streamed-weights.json"
STREAMED_SUFFIX = ".safetensors"
# Objects --skip-weights leaves in the store: the streamed format and the ones nothing here loads.
WEIGHT_SUFFIXES = (STREAMED_SUFFIX, ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def is_weight(rel: str) -> bool:
    return rel.lower().endswith(WEIGHT_SUFFIXES)


@dataclass(frozen=True, slots=True)
class StreamManifest:
    """``uri``: the model's canonical URI; ``files``: its ``*.safetensors`` objects, as listed."""

    uri: str
    files: tuple[RemoteFile, ...]

    def write(self, folder: Path) -> None:
        data = {"uri": self.uri, "files": [dataclasses.asdict(f) for f in self.files]}
        (folder / MANIFEST).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")

    @classmethod
    def read(cls, folder: Path) -> StreamManifest | None:
        """The folder's manifest; None when it has none; ValueError naming the file when it is unreadable."""
        path = folder / MANIFEST
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(str(data["uri"]), tuple(RemoteFile(**f) for f in data["files"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a streamed-weights manifest ({e})") from e
