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


def test_whole_cpu_parameters_become_private_mappings_of_the_file(stored: Path, tmp_path: Path) -> None:
    """A parameter one in-order run of the file fills (a tensor taken whole, or two stored side by
    side for one merged parameter) is mapped, not read: equal bytes, and a write to it never
    reaches the file (a private mapping copies the page)."""
    want = load_file(str(stored))
    header = loader.read_header(stored)
    whole = torch.empty(300, 70, dtype=torch.bfloat16)
    ids = torch.empty(5, 7, dtype=torch.int8)
    merged = torch.empty(33 + 33, dtype=torch.float32)  # b twice: not one run of the file
    params = {"whole": whole, "ids": ids, "merged": merged}
    reads = loader.ParallelReads(params)
    reads.add(stored, header["a.weight"], whole)
    reads.add(stored, header["c.ids"], ids)
    reads.add(stored, header["b.weight"], merged[:33])
    reads.add(stored, header["b.weight"], merged[33:])
    before = stored.read_bytes()
    reads.run()
    assert reads.mapped_bytes == whole.nbytes + ids.nbytes  # the dict's tensors now view the file
    assert torch.equal(params["whole"], want["a.weight"]) and torch.equal(params["ids"], want["c.ids"])
    assert torch.equal(merged, torch.cat([want["b.weight"]] * 2))  # read, as before
    params["whole"].zero_()
    assert stored.read_bytes() == before
    assert torch.equal(load_file(str(stored))["a.weight"], want["a.weight"])


def test_a_truncated_file_is_read_not_mapped(stored: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(stored.read_bytes()[:-500])
    header = loader.read_header(cut)
    target = torch.empty(300, 70, dtype=torch.bfloat16)
    reads = loader.ParallelReads({"a": target})
    reads.add(cut, header["a.weight"], target)
    assert header["a.weight"].offset + header["a.weight"].nbytes > cut.stat().st_size  # a.weight is cut
    with pytest.raises(ValueError, match=r"ended \d+ bytes early"):
        reads.run()
