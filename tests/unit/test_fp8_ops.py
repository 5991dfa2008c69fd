"""FP8's parts on their own: the numbers (model/quant/fp8.py), the formats a quantization_config may
declare (formats.py), the GEMM each device gets (gemm.py, as the device profile asks) and the GPU
path's own code run on CPU's FP8 kernel (torch has a rowwise ``scaled_mm`` on CPU too)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.scheduler.model.device import resolve_profile
from radixserve.scheduler.model.quant.formats import Fp8Format, WeightQuant, checkpoint_format
from radixserve.scheduler.model.quant.fp8 import (
    FP8,
    ScaleLayout,
    dequantize,
    quantize_blocks,
    quantize_rows,
    quantize_tokens,
)
from radixserve.scheduler.model.quant.gemm import DEQUANT, SCALED_MM, Fp8Gemms, choose_gemms, probe_scaled_mm
from radixserve.scheduler.model.quant.linear import Fp8Linear
from tests.helpers.shapes import QWEN3_06B

BLOCK = ScaleLayout((128, 128))
E4M3_STEP = 2**-3  # e4m3 keeps 3 mantissa bits: a value rounds by at most half a step, 1/16 relative


@pytest.mark.parametrize("layout", [ScaleLayout(), BLOCK], ids=["rows", "blocks"])
def test_weights_round_trip_within_half_an_e4m3_step_2d_and_stacked(layout):
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 200, 300, generator=g) * torch.rand(3, 200, 1, generator=g)  # uneven rows
    stacked[1, 5] = 0  # an all-zero row dequantizes to zeros, not NaN
    quant = quantize_rows if layout.block is None else (lambda w: quantize_blocks(w, BLOCK.block))
    q, scale = quant(stacked)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert (
        scale.shape == layout.scale_shape(stacked.shape) == ((3, 200) if layout.block is None else (3, 2, 3))
    )
    back = dequantize(q, scale, layout, torch.float32)
    assert torch.equal(back[1, 5], torch.zeros(300))
    # normal values within half a step of their exponent; tiny ones within FP8's smallest subnormal step
    bound = (
        stacked.abs() * E4M3_STEP / 2 + dequantize(torch.ones_like(q), scale, layout, torch.float32) * 2**-9
    )
    assert ((back - stacked).abs() <= bound).all()
    for e in range(3):  # stacked experts are quantized as each one alone would be
        q2, s2 = quant(stacked[e])
        assert torch.equal(q2.view(torch.uint8), q[e].view(torch.uint8)) and torch.equal(s2, scale[e])


def test_tokens_are_quantized_one_scale_per_row():
    x = (
        torch.randn(5, 64, dtype=torch.bfloat16)
        * torch.tensor([1e-3, 1, 10, 100, 0]).to(torch.bfloat16)[:, None]
    )
    q, scale = quantize_tokens(x)
    assert scale.shape == (5, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1)[:4], torch.full((4,), 448.0))  # each row's largest -> 448
    torch.testing.assert_close((q.float() * scale)[:4], x[:4].float(), rtol=E4M3_STEP, atol=0)
    assert torch.equal(q[4].float(), torch.zeros(64))


def test_the_gpu_paths_scaled_mm_code_runs_on_cpus_fp8_kernel():
    """Per-token activation scales x per-row weight scales through torch's scaled_mm (its CPU kernel
    here), against the dequantize path on the same weight: within the activations' rounding."""
    g = torch.Generator().manual_seed(1)
    linear = Fp8Linear(256, 128, True, ScaleLayout(), torch.bfloat16)
    q, scale = quantize_rows(torch.randn(128, 256, generator=g) * 0.05)
    with torch.no_grad():
        linear.weight.copy_(q)
        linear.weight_scale.copy_(scale)
        linear.bias.copy_(torch.randn(128, generator=g))  # type: ignore[union-attr]
    x = torch.randn(2, 7, 256, generator=g).to(torch.bfloat16)
    want = linear(x)  # dequantized per matmul (the default until the runner picks)
    linear.use(SCALED_MM)
    got = linear(x)
    assert got.shape == want.shape == (2, 7, 128) and got.dtype == torch.bfloat16
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    print(f"scaled_mm vs dequantize: max error {err:.4f} of the largest output")
    assert err < 0.03


def test_the_probe_passes_a_working_gemm_and_names_a_failing_one():
    """The device profile's probe: the rowwise GEMM runs on CPU's kernel and agrees with the
    dequantized matmul; torch has no blockwise kernel on CPU, and the probe says so."""
    assert probe_scaled_mm(torch.device("cpu"), ScaleLayout()) is None
    failed = probe_scaled_mm(torch.device("cpu"), BLOCK)
    assert failed is not None and failed.startswith("torch.nn.functional.scaled_mm failed a probe call: ")


SHAPES = [(768, 256), (256, 256), (1024, 256), (256, 512)]
BLOCKS = WeightQuant(Fp8Format("fp8", "block", "weight_scale_inv", (128, 128)))
ROWS = WeightQuant(None, at_load=True)


def _choose(quant, capability, cuda=(12, 9), dtype=torch.bfloat16, probe=lambda layout: None, shapes=SHAPES):
    dev = torch.device("cuda" if capability else "cpu")
    return choose_gemms(dev, dtype, quant, shapes, capability, cuda, probe)


def test_the_gemm_each_device_gets_and_the_line_that_says_why():
    gemms, notes = _choose(ROWS, None)
    assert gemms == Fp8Gemms(DEQUANT, DEQUANT) and "dequantized to bfloat16 per matmul on CPU" in notes[0]
    gemms, notes = _choose(ROWS, (8, 0))  # A100: no FP8 tensor cores
    assert gemms.rows == DEQUANT and "compute capability 8.0 has no FP8 tensor cores" in notes[0]
    gemms, notes = _choose(ROWS, (8, 9))  # L40S / Ada: rowwise FP8
    assert (
        gemms.rows == SCALED_MM and "scaled_mm (per-token activation x per-channel weight scales)" in notes[0]
    )
    gemms, notes = _choose(BLOCKS, (8, 9))  # the blockwise recipe is Hopper's
    assert (
        gemms == Fp8Gemms(SCALED_MM, DEQUANT) and "runs on compute capability 9.0 with CUDA 12.9+" in notes[0]
    )
    gemms, notes = _choose(BLOCKS, (9, 0))
    assert (
        gemms == Fp8Gemms(SCALED_MM, SCALED_MM) and "(1x128 activation x 128x128 weight scales)" in notes[0]
    )
    assert _choose(BLOCKS, (9, 0), cuda=(12, 4))[0].blocks == DEQUANT
    assert _choose(BLOCKS, (9, 0), shapes=[(768, 200)])[0] == Fp8Gemms(DEQUANT, DEQUANT)  # not whole blocks
    gemms, notes = _choose(ROWS, (9, 0), dtype=torch.float16)
    assert gemms.rows == DEQUANT and "writes bfloat16; this model serves in float16" in notes[0]
    gemms, notes = _choose(BLOCKS, (9, 0), probe=lambda layout: "no kernel" if layout.block else None)
    assert gemms == Fp8Gemms(SCALED_MM, DEQUANT) and notes[0].endswith("per matmul: no kernel")


def test_the_cpu_profile_dequantizes_and_says_so():
    cfg = dataclasses.replace(QWEN3_06B, quantization=BLOCKS)
    p = resolve_profile(cfg, device="cpu")
    assert p.fp8_gemms == Fp8Gemms(DEQUANT, DEQUANT)
    assert p.notes == (
        "FP8 weights (fp8 checkpoint, 128x128 blocks): dequantized to bfloat16 per matmul on CPU",
    )
    assert resolve_profile(QWEN3_06B, device="cpu").fp8_gemms is None


def _ct(weights: dict, acts: dict | None = None, **top) -> dict:
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", **weights},
        "input_activations": acts,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": group},
        **top,
    }


def test_the_served_formats_are_read_from_their_quantization_configs():
    fp8 = checkpoint_format(
        {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    )
    assert fp8 == Fp8Format("fp8", "block", "weight_scale_inv", (128, 128))
    assert checkpoint_format({"quant_method": "fp8", "activation_scheme": "static"}) == Fp8Format(
        "fp8", "tensor", "weight_scale", static_input_scales=True
    )
    assert checkpoint_format({"quant_method": "fbgemm_fp8"}) == Fp8Format(
        "fbgemm_fp8", "channel", "weight_scale"
    )
    channel = _ct({"strategy": "channel"}, {"dynamic": True, "strategy": "token"})
    assert checkpoint_format(channel) == Fp8Format("compressed-tensors", "channel", "weight_scale")
    blocks = _ct({"strategy": "block", "block_structure": [128, 128]}, {"dynamic": True, "strategy": "group"})
    assert checkpoint_format(blocks) == Fp8Format("compressed-tensors", "block", "weight_scale", (128, 128))
    static = checkpoint_format(_ct({"strategy": "tensor"}, {"dynamic": False, "strategy": "tensor"}))
    assert static is not None and static.granularity == "tensor" and static.static_input_scales
    assert checkpoint_format(None) is None


@pytest.mark.parametrize(
    ("config", "error"),
    [
        (_ct({"strategy": "channel"}, kv_cache_scheme={"num_bits": 8}), "with a kv_cache_scheme"),
        (_ct({"strategy": "channel", "type": "int"}), "with int 8-bit weights"),
        (_ct({"strategy": "group", "group_size": 128}), "with weight strategy 'group'"),
        ({**_ct({"strategy": "channel"}), "config_groups": {"a": {}, "b": {}}}, "with 2 config_groups"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]: expected"),
    ],
)
def test_a_format_we_do_not_serve_says_which_part(config, error):
    with pytest.raises(ValueError, match=error):
        checkpoint_format(config)
