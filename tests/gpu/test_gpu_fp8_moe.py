"""CUDA tests of FP8 experts: the FP8 grouped GEMM path (model/quant/grouped.py) against the torch
reference on the same FP8 weights (each routed expert dequantized), eagerly and replayed from a CUDA
graph; and engines serving an FP8 Qwen3-MoE against the same weights dequantized.

Skipped without CUDA; where the device profile does not pick the FP8 grouped GEMM (a GPU other than
SM90, a torch without the kernel, a failing probe) the op test is skipped with the profile's reason.
Written without a GPU and not yet run on one (docs/quantization.md says so). The CPU side (loading,
numerics, the choice, launches and capturability on fake CUDA tensors) is tests/unit/test_fp8_moe.py,
test_device_profile.py and test_launch_count.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.scheduler.model.device import resolve_profile
from radixserve.scheduler.model.ops import TorchOps
from radixserve.scheduler.model.quant.formats import WeightQuant
from radixserve.scheduler.model.quant.fp8 import ScaleLayout, quantize_rows
from radixserve.scheduler.model.quant.grouped import SCALED_GROUPED
from radixserve.scheduler.model.quant.linear import Fp8Weight
from tests.gpu.agreement import FP8_LOGPROB_TOL, assert_equal_but_near_ties
from tests.helpers.fp8_models import source_model, write_fp8
from tests.helpers.hf import PROMPTS
from tests.helpers.shapes import QWEN3_30B_A3B

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def _grouped_or_skip() -> None:
    """Skip unless the device profile puts FP8 experts scaled per row on the FP8 grouped GEMM here."""
    cfg = dataclasses.replace(QWEN3_30B_A3B, quantization=WeightQuant(None, at_load=True))
    p = resolve_profile(cfg, device="cuda")
    (note,) = [n for n in p.notes if n.startswith("MoE experts")]
    print(note)
    if p.moe != SCALED_GROUPED:
        pytest.skip(note)


def _stack(shape: tuple[int, int, int], g: torch.Generator) -> Fp8Weight:
    q, scale = quantize_rows(torch.randn(shape, generator=g) * 0.02)
    stack = Fp8Weight(shape, ScaleLayout())
    with torch.no_grad():
        stack.weight.copy_(q)
        stack.weight_scale.copy_(scale)
    return stack.to(DEV)


def test_fp8_grouped_experts_agree_with_the_dequantized_reference():
    """16 experts (one no token picks), top-4, hidden 1024, 384 wide, 37 tokens; then new tokens
    through the same captured graph (new routing, same shapes)."""
    _grouped_or_skip()
    g = torch.Generator().manual_seed(0)
    gate_up, down = _stack((16, 768, 1024), g), _stack((16, 1024, 384), g)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        x, logits = torch.randn(37, 1024, generator=g), torch.randn(37, 16, generator=g)
        logits[:, 3] = -30.0
        return x.to(DEV, torch.bfloat16), logits.to(DEV, torch.bfloat16)

    reference, grouped = TorchOps("torch"), TorchOps(SCALED_GROUPED)
    x, logits = inputs()
    want = reference.moe(x, logits, gate_up, down, 4, True).float()
    got = grouped.moe(x, logits, gate_up, down, 4, True).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"FP8 grouped GEMM vs each routed expert dequantized: max error {err:.4f} of the largest output")
    assert err < 0.06  # the activations quantized per row before each of the two GEMMs
    static_x, static_logits = x.clone(), logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped.moe(static_x, static_logits, gate_up, down, 4, True)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        eager = grouped.moe(static_x, static_logits, gate_up, down, 4, True)
        torch.testing.assert_close(out.float(), eager.float(), rtol=1e-2, atol=1e-3)
        x, logits = inputs()
        static_x.copy_(x)
        static_logits.copy_(logits)


def test_fp8_moe_checkpoints_agree_with_their_dequantized_weights(tmp_path):
    """Qwen3-MoE in the block format (its experts on the torch reference: no blockwise grouped GEMM)
    and with --quantization fp8 (per row: the FP8 grouped GEMM, decode graphs on, where the profile
    picks it) against the same weights dequantized, all served in bfloat16."""
    src = source_model(tmp_path / "src", "qwen3_moe")
    for fmt in ("block", "load"):
        fp8, ref = write_fp8(src, tmp_path / fmt, fmt)
        outs = {}
        for name, path, q in (("fp8", fp8, "fp8" if fmt == "load" else "none"), ("reference", ref, "none")):
            with Engine(path, device="cuda", dtype="bfloat16", quantization=q, max_total_tokens=4096) as e:
                outs[name] = e.generate(prompt=PROMPTS, sampling_params=GREEDY)
                print(fmt, name, e.profile.moe, e.profile.notes, e.placement["weight_bytes_per_rank"])
                if name == "fp8" and fmt == "block":
                    assert e.profile.moe == "torch" and not e.profile.cuda_graph
        assert_equal_but_near_ties(
            outs["fp8"], outs["reference"], FP8_LOGPROB_TOL, f"{fmt} FP8 MoE vs dequantized"
        )
