"""The device profile (model/device.py): dtype, backend, fused ops, graphs and an MoE model's
experts (FP8 ones too) decided in one place, every surprising choice said in a note. CUDA is out of
reach here, so the CUDA cases resolve with a CUDA device named but absent (``resolve_device`` stood
in: the GPU is outside this machine, and for MoE models its compute capability, ``cuda_capability``,
and the FP8 grouped GEMM's probe); tests/gpu checks the same choices on a real GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.scheduler.model import device as device_mod
from radixserve.scheduler.model.device import resolve_device, resolve_profile
from radixserve.scheduler.model.quant.formats import Fp8Format, WeightQuant
from radixserve.scheduler.model.quant.gemm import Fp8Gemms
from tests.helpers.shapes import QWEN3_06B, QWEN3_30B_A3B

FP32 = dataclasses.replace(QWEN3_06B, dtype=torch.float32)


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(device_mod, "resolve_device", lambda name: torch.device("cuda", 0))
    # flashinfer absent here: the profile must say what that costs, never fail silently
    monkeypatch.setattr(device_mod, "choose_backend", lambda *a: "flashinfer")


def test_cpu_keeps_the_checkpoint_dtype_and_has_no_graphs():
    p = resolve_profile(FP32, device="cpu")
    assert (p.dtype, p.ops, p.graph_max_bs, p.cuda_graph) == (torch.float32, "torch", 0, False)
    assert p.notes == ()
    assert resolve_profile(FP32, device="cpu", cpu_static_decode=True, cuda_graph_max_bs=8).graph_max_bs == 8


def test_float32_checkpoint_serves_in_bf16_on_cuda(on_cuda, monkeypatch):
    # what a CUDA machine without flashinfer sees, on every machine (this one has none anyway)
    monkeypatch.setattr(device_mod, "unsupported_reason", lambda *a: "flashinfer is not installed")
    p = resolve_profile(FP32, device="cuda")
    assert p.dtype == torch.bfloat16
    assert any("float32 checkpoint served in bfloat16" in n for n in p.notes)
    assert p.attention_backend == "flashinfer" and p.cuda_graph and p.graph_max_bs == 64
    assert any("unfused torch ops" in n and "not installed" in n for n in p.notes)


def test_explicit_float32_on_cuda_is_honoured_on_the_torch_backend(on_cuda, monkeypatch):
    monkeypatch.setattr(device_mod, "choose_backend", lambda *a: "torch")
    p = resolve_profile(FP32, device="cuda", dtype="float32")
    assert (p.dtype, p.attention_backend, p.cuda_graph) == (torch.float32, "torch", False)
    assert any("graphs off" in n for n in p.notes)
    with pytest.raises(ValueError, match="no float32 kernels"):
        resolve_profile(FP32, device="cuda", dtype="float32", attention_backend="flashinfer")


def test_disable_cuda_graph_and_the_batch_cap(on_cuda):
    assert resolve_profile(QWEN3_06B, device="cuda", disable_cuda_graph=True).graph_max_bs == 0
    p = resolve_profile(QWEN3_06B, device="cuda", cuda_graph_max_bs=160, max_running_requests=48)
    assert p.graph_max_bs == 48


def test_bad_arguments_are_refused_at_start():
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_profile(FP32, device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_profile(FP32, device="cpu", attention_backend="xformers")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_profile(FP32, device="cpu", attention_backend="flashinfer")
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:1")


def test_an_moe_model_on_cpu_runs_the_torch_experts_and_says_so():
    p = resolve_profile(QWEN3_30B_A3B, device="cpu", cpu_static_decode=True, cuda_graph_max_bs=8)
    assert (p.moe, p.graph_max_bs) == ("torch", 8)  # the padded static path needs no graph
    (note,) = [n for n in p.notes if n.startswith("MoE experts")]
    assert note.startswith("MoE experts: the torch reference") and "need a CUDA device" in note


def test_an_moe_model_on_cuda_runs_grouped_gemms_where_torch_has_them(on_cuda, monkeypatch):
    monkeypatch.setattr(device_mod, "cuda_capability", lambda dev: (9, 0))  # an H100
    h100 = resolve_profile(QWEN3_30B_A3B, device="cuda")
    assert (h100.moe, h100.cuda_graph) == ("grouped_mm", True)
    assert any(n.startswith("MoE experts: grouped GEMMs") for n in h100.notes)
    fp16 = resolve_profile(QWEN3_30B_A3B, device="cuda", dtype="float16")
    assert fp16.moe == "torch" and any("bfloat16 only, not float16" in n for n in fp16.notes)
    monkeypatch.setattr(device_mod, "cuda_capability", lambda dev: (8, 0))  # an A100: no such kernels
    a100 = resolve_profile(QWEN3_30B_A3B, device="cuda")
    assert (a100.moe, a100.cuda_graph, a100.graph_max_bs) == ("torch", False, 0)
    assert any("not SM80" in n for n in a100.notes)
    assert "CUDA graphs off: the torch MoE experts read their row counts on the host" in a100.notes
    dense = resolve_profile(QWEN3_06B, device="cuda")
    assert dense.cuda_graph and not any("MoE" in n for n in dense.notes)


BLOCKS = WeightQuant(Fp8Format("fp8", "block", "weight_scale_inv", (128, 128)))
A3B_ROWS = dataclasses.replace(QWEN3_30B_A3B, quantization=WeightQuant(None, at_load=True))
A3B_BLOCKS = dataclasses.replace(QWEN3_30B_A3B, quantization=BLOCKS)


def test_fp8_experts_on_cpu_dequantize_each_routed_expert_and_say_so():
    p = resolve_profile(A3B_BLOCKS, device="cpu")
    assert p.moe == "torch"
    assert (
        "MoE experts in FP8 (128x128 blocks): the torch reference, each routed expert dequantized to"
        " bfloat16 per matmul (FP8 grouped GEMM kernels need a CUDA device)"
    ) in p.notes


def test_fp8_experts_on_cuda_take_the_fp8_grouped_gemm_where_it_runs(on_cuda, monkeypatch):
    monkeypatch.setattr(device_mod, "device_gemms", lambda *a: (Fp8Gemms(), []))  # test_fp8_ops.py's
    monkeypatch.setattr(device_mod, "cuda_capability", lambda dev: (9, 0))  # an H100
    monkeypatch.setattr(device_mod, "probe_scaled_grouped_mm", lambda dev: None)
    h100 = resolve_profile(A3B_ROWS, device="cuda")
    assert (h100.moe, h100.cuda_graph) == ("scaled_grouped_mm", True)
    assert any(
        n.startswith("MoE experts in FP8 (per output row): torch.nn.functional.scaled_grouped_mm")
        and n.endswith("CUDA-graph safe")
        for n in h100.notes
    )
    blocks = resolve_profile(A3B_BLOCKS, device="cuda")  # Qwen3-30B-A3B-FP8: no blockwise kernel
    assert (blocks.moe, blocks.cuda_graph) == ("torch", False)
    assert any("(torch has no blockwise FP8 grouped GEMM)" in n for n in blocks.notes)
    assert "CUDA graphs off: the torch MoE experts read their row counts on the host" in blocks.notes
    fp16 = resolve_profile(A3B_ROWS, device="cuda", dtype="float16")
    assert fp16.moe == "torch" and any(
        "writes bfloat16; this model serves in float16" in n for n in fp16.notes
    )
    monkeypatch.setattr(device_mod, "probe_scaled_grouped_mm", lambda dev: "it failed a probe call: no")
    probed = resolve_profile(A3B_ROWS, device="cuda")
    assert probed.moe == "torch" and any(n.endswith("(it failed a probe call: no)") for n in probed.notes)
    monkeypatch.setattr(device_mod, "cuda_capability", lambda dev: (10, 0))  # a B200
    b200 = resolve_profile(A3B_ROWS, device="cuda")
    assert b200.moe == "torch" and any("built for SM90, not SM100" in n for n in b200.notes)
