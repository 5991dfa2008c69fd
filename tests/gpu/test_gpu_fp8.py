"""CUDA tests of FP8 weights: the tensor-core GEMMs against the dequantized matmul, engines with FP8
weights against the same weights dequantized, and loading that leaves nothing in torch's cache (the
KV pool is sized from the memory left after the weights: an FP8 model's freed half is KV).

Skipped without CUDA; a GEMM the device profile does not pick here (a GPU without FP8 tensor cores,
the blockwise recipe off Hopper) is skipped with the profile's reason. The CPU side (formats, the
loader, numerics, the GEMM choice, launch counts) is tests/unit/test_fp8*.py and test_launch_count.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.common.demo_model import make_demo_model
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.device import resolve_profile
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.quant.formats import Fp8Format, WeightQuant
from radixserve.scheduler.model.quant.fp8 import ScaleLayout, quantize_blocks, quantize_rows
from radixserve.scheduler.model.quant.gemm import SCALED_MM
from radixserve.scheduler.model.quant.linear import Fp8Linear
from tests.gpu.agreement import FP8_LOGPROB_TOL, assert_equal_but_near_ties
from tests.helpers.fp8_models import source_model, write_fp8
from tests.helpers.hf import PROMPTS
from tests.helpers.shapes import QWEN3_06B

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def _gemm_or_skip(layout: ScaleLayout) -> None:
    """Skip unless the device profile puts ``layout``'s weights on the tensor cores here."""
    fmt = Fp8Format("fp8", "block", "weight_scale_inv", layout.block) if layout.block else None
    p = resolve_profile(
        dataclasses.replace(QWEN3_06B, quantization=WeightQuant(fmt, fmt is None)), device="cuda"
    )
    assert p.fp8_gemms is not None
    chosen = p.fp8_gemms.blocks if layout.block else p.fp8_gemms.rows
    print(p.notes[-1])
    if chosen != SCALED_MM:
        pytest.skip(p.notes[-1])


@pytest.mark.parametrize("layout", [ScaleLayout(), ScaleLayout((128, 128))], ids=["rows", "blocks"])
def test_fp8_gemm_agrees_with_the_dequantized_matmul(layout):
    _gemm_or_skip(layout)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(768, 1024, generator=g) * 0.02
    q, scale = quantize_rows(w) if layout.block is None else quantize_blocks(w, layout.block)
    linear = Fp8Linear(1024, 768, False, layout, torch.bfloat16).to(DEV)
    with torch.no_grad():
        linear.weight.copy_(q.to(DEV))
        linear.weight_scale.copy_(scale.to(DEV))
    x = torch.randn(37, 1024, generator=g).to(DEV, torch.bfloat16)
    want = linear(x).float()  # dequantized per matmul
    linear.use(SCALED_MM)
    got = linear(x).float()
    graph = torch.cuda.CUDAGraph()  # and inside a captured graph, as decode runs it
    static = x.clone()
    with torch.cuda.graph(graph):
        out = linear(static)
    graph.replay()
    torch.cuda.synchronize()
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{layout}: scaled_mm vs dequantized: max error {err:.4f} of the largest output")
    assert err < 0.03
    torch.testing.assert_close(out.float(), got, rtol=1e-2, atol=1e-3)  # the replay computes the same


def test_block_fp8_checkpoint_agrees_with_its_dequantized_weights(tmp_path):
    fp8, ref = write_fp8(source_model(tmp_path / "src", "qwen3"), tmp_path / "block", "block")
    outs = {}
    for name, path in (("fp8", fp8), ("reference", ref)):
        with Engine(path, device="cuda", attention_backend="torch", max_total_tokens=4096) as e:
            outs[name] = e.generate(prompt=PROMPTS, sampling_params=GREEDY)
            print(name, e.profile.notes, e.placement["weight_bytes_per_rank"])
    assert_equal_but_near_ties(outs["fp8"], outs["reference"], FP8_LOGPROB_TOL, "block FP8 vs dequantized")


def test_quantization_fp8_on_cuda_graphs_agrees_with_bf16_and_leaves_no_cache(tmp_path):
    """--quantization fp8 on the small demo model (flashinfer, decode graphs) against the same model
    in bf16; loading it leaves nothing in torch's cache but fragments (quantizing on the GPU makes a
    bf16 temporary per tensor), so the KV sizing sees the memory FP8 freed."""
    pytest.importorskip("flashinfer", reason="decode graphs need flashinfer")
    path = make_demo_model(tmp_path / "small", "qwen3", "small")
    cfg = ModelConfig.from_pretrained(path, "bfloat16", "fp8")
    model = load_model(path, cfg, DEV)
    cached = torch.cuda.memory_reserved(DEV) - torch.cuda.memory_allocated(DEV)
    allocated = torch.cuda.memory_allocated(DEV)
    print(f"after loading: {cached / 2**20:.1f} MiB cached, {allocated / 2**20:.1f} MiB allocated")
    assert cached < 32 * 2**20
    del model
    outs, weights = {}, {}
    for q in ("fp8", "none"):
        with Engine(path, device="cuda", dtype="bfloat16", quantization=q, max_total_tokens=8192) as e:
            outs[q] = e.generate(prompt=PROMPTS, sampling_params=GREEDY)
            weights[q] = e.placement["weight_bytes_per_rank"][0]
            assert e.profile.cuda_graph
    assert weights["fp8"] < 0.6 * weights["none"]
    assert_equal_but_near_ties(outs["fp8"], outs["none"], FP8_LOGPROB_TOL, "--quantization fp8 vs bf16")
