"""The loader's file reading (model/loader.py, ParallelReads): tensors read with pread straight into
their targets, in chunks over threads, are the bytes safetensors itself reads; another dtype is
converted; a truncated file is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.scheduler.model import loader


@pytest.fixture
def stored(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(300, 70, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(33, generator=g),
        "c.ids": torch.randint(-100, 100, (5, 7), generator=g, dtype=torch.int8),
        "d.empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors"


def test_reads_match_safetensors_across_chunks_and_dtypes(stored: Path, monkeypatch) -> None:
    monkeypatch.setattr(loader, "READ_CHUNK_BYTES", 1000)  # many chunks per tensor, over the threads
    want = load_file(str(stored))
    header = loader.read_header(stored)
    assert set(header) == set(want) and header["a.weight"].shape == (300, 70)
    reads = loader.ParallelReads()
    same = {name: torch.empty_like(t) for name, t in want.items()}
    as_f32 = torch.empty(300, 70, dtype=torch.float32)  # stored bf16, served f32: converted
    for name, target in same.items():
        reads.add(stored, header[name], target)
    reads.add(stored, header["a.weight"], as_f32)
    reads.run()
    for name, t in want.items():
        assert torch.equal(same[name], t), name
    assert torch.equal(as_f32, want["a.weight"].float())


def test_a_truncated_file_is_a_clear_error(stored: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(stored.read_bytes()[:-500])
    header = loader.read_header(cut)
    reads = loader.ParallelReads()
    reads.add(cut, header["a.weight"], torch.empty(300, 70, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"ended \d+ bytes early"):
        reads.run()
