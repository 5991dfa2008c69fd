"""What the streamed-weights tests share, whatever the store (S3: test_weight_stream.py, GCS:
test_model_source_gcs.py): a model split into shards, its weights loaded from a folder or streamed
as the folder's manifest says, and the memory files a stream holds."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from radixserve.common.model_source import tree_files
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.weight_stream import StreamedWeights


def sharded_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` (one ``model.safetensors``) in three shards and an index at ``out``, as large
    checkpoints come."""
    out.mkdir(parents=True)
    for rel in tree_files(model_dir):
        if not rel.endswith(".safetensors"):
            (out / rel).write_bytes((model_dir / rel).read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    thirds = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}
    for shard, part in thirds.items():
        save_file({n: tensors[n].contiguous() for n in part}, out / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: shard for shard, part in thirds.items() for n in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def streamed(folder: Path, **kw: Any) -> StreamedWeights:
    """The stream of the shards ``folder``'s manifest lists (``kw``: StreamedWeights' options)."""
    return StreamedWeights.of(folder, **kw)


def weights_of(folder: Path, **kw: Any) -> dict[str, torch.Tensor]:
    """The loaded model's weights: from the folder's files, or, with ``kw``, streamed."""
    cfg = ModelConfig.from_pretrained(folder)
    return load_model(folder, cfg, "cpu", weights=streamed(folder, **kw) if kw else None).state_dict()


def memory_files() -> list[str]:
    """This process's open memory files (memfd_create's): the shards a stream holds."""
    fds = Path("/proc/self/fd")
    return [
        link for fd in fds.iterdir() if (link := os.readlink(fd) if fd.exists() else "").startswith("/memfd:")
    ]
