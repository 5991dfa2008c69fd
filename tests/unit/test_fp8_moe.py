"""FP8 experts end to end on CPU: Qwen3-MoE, Qwen2-MoE and Mixtral in each checkpoint format (128x128
blocks, per channel, per tensor) and with ``--quantization fp8``, loaded by the real loader and served
by the engine, against HF transformers run on the same weights dequantized.

Tolerance: the logits of a 40-token prompt (every position) within 1e-4 of HF's (float32: the experts
dequantized per matmul, only those routed to; the rest is float32 rounding), greedy tokens (3 prompts
x 12) identical. Resident weights: the engine's own report (``placement``) is exactly the FP8
projections and experts (1 byte a parameter) plus their float32 scales plus the rest in the serving
dtype; the projections and experts are half their bf16 bytes (plus 1.6% per-row scales at K=256).
The stacked layout, a rank's part of every expert and its scales, each bad checkpoint's line, the op
on its own and the path each device gets are here too; tensor parallelism over processes is
tests/integration/test_tensor_parallel.py's, the GPU's grouped GEMM tests/gpu/test_gpu_fp8_moe.py's.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from radixserve import Engine
from radixserve.common.demo_moe import MOE_ARCHS
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.moe_ops import route
from radixserve.scheduler.model.ops import TorchOps
from radixserve.scheduler.model.parallel import ShardLayout, TPGroup, tp_problem
from radixserve.scheduler.model.quant.formats import Fp8Format, WeightQuant
from radixserve.scheduler.model.quant.fp8 import FP8, ScaleLayout, quantize_blocks, quantize_rows
from radixserve.scheduler.model.quant.grouped import SCALED_GROUPED
from radixserve.scheduler.model.quant.linear import Fp8Experts, Fp8Weight
from tests.helpers.fp8_models import (
    edit_checkpoint,
    expected_bytes,
    projection_bytes,
    source_model,
    write_fp8,
)
from tests.helpers.model_logits import served_like_hf
from tests.helpers.moe_checkpoints import stack_experts
from tests.helpers.shapes import QWEN3_30B_A3B

FORMATS = ("block", "channel", "tensor", "load")
BLOCKS = WeightQuant(Fp8Format("fp8", "block", "weight_scale_inv", (128, 128)))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-moe-src")
    return {arch: source_model(root / arch, arch) for arch in MOE_ARCHS}


@pytest.fixture(scope="module")
def block(sources, tmp_path_factory):
    """Qwen2-MoE (shared expert and its gate) in the block format: (FP8 folder, reference folder)."""
    return write_fp8(sources["qwen2_moe"], tmp_path_factory.mktemp("fp8-moe") / "block", "block")


def _fp8_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8:
        return b.dtype == FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


# ------------------------------------------------------------------ each architecture x format
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fp8_experts_logits_tokens_and_bytes_match_hf_on_the_dequantized_weights(
    sources, tmp_path, arch, fmt
):
    folder, ref = write_fp8(sources[arch], tmp_path / fmt, fmt)
    served = served_like_hf(folder, ref, "fp8" if fmt == "load" else "none", f"{arch} {fmt}")
    cfg = served.model.config
    assert cfg.moe is not None
    for i in cfg.moe.sparse_layers:  # the experts FP8 in the checkpoint's layout, the router not
        moe = served.model.model.layers[i].mlp
        assert isinstance(moe.experts, Fp8Experts) and moe.gate.weight.dtype == cfg.dtype
        assert moe.experts.gate_up_proj.layout == ScaleLayout((128, 128) if fmt == "block" else None)
    (note,) = [n for n in served.profile.notes if n.startswith("MoE experts")]
    assert served.profile.moe == "torch" and "each routed expert dequantized" in note
    report = served.weight_bytes
    assert report == [expected_bytes(ref, fmt, dtype_bytes=4)[0]]
    fp8, bf16 = projection_bytes(ref, fmt)
    print(f"{arch} {fmt}: weights {report[0]} bytes; projections and experts {fp8 / bf16:.3f} of bf16")
    assert 0.5 <= fp8 / bf16 < 0.52


# ------------------------------------------------------------------ the op
def _fp8_stacks(layout: ScaleLayout, num: int = 6, width: int = 32, hidden: int = 64) -> list[Fp8Weight]:
    g = torch.Generator().manual_seed(0)
    stacks = []
    for shape in ((num, 2 * width, hidden), (num, hidden, width)):
        w = torch.randn(shape, generator=g) * torch.rand(num, 1, 1, generator=g)  # experts of unequal size
        q, scale = quantize_rows(w) if layout.block is None else quantize_blocks(w, layout.block)
        stack = Fp8Weight(shape, layout)
        with torch.no_grad():
            stack.weight.copy_(q)
            stack.weight_scale.copy_(scale)
        stacks.append(stack)
    return stacks


@pytest.mark.parametrize("layout", [ScaleLayout(), ScaleLayout((16, 16))], ids=["rows", "blocks"])
@pytest.mark.parametrize("experts", ["torch", "grouped_mm"])
def test_fp8_experts_compute_what_their_dequantized_weights_do(experts, layout, monkeypatch):
    """The op on FP8 stacks equals the op on the same stacks dequantized (test_moe.py holds that one
    to the per-token formula); the torch reference dequantizes only the experts routed to. (The FP8
    grouped GEMM has no CPU kernel: tests/gpu/test_gpu_fp8_moe.py; on blocks it is ``grouped_mm``.)"""
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(9, 64, generator=g), torch.randn(9, 6, generator=g)
    logits[:, 5] = -30.0  # an expert no token picks
    gate_up, down = _fp8_stacks(layout)
    seen: set[int] = set()
    expert = Fp8Weight.expert

    def counted(self: Fp8Weight, e: int, dtype: torch.dtype) -> torch.Tensor:
        seen.add(e)
        return expert(self, e, dtype)

    monkeypatch.setattr(Fp8Weight, "expert", counted)
    got = TorchOps(experts).moe(x, logits, gate_up, down, 3, True)
    want = TorchOps("torch").moe(x, logits, gate_up.dequantize(x.dtype), down.dequantize(x.dtype), 3, True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if experts == "torch":
        assert seen == set(route(logits, 3, True).ids.flatten().tolist()) and 5 not in seen
    if layout.block is not None:  # the FP8 grouped GEMM takes rows only: blocks run grouped_mm
        blocks = TorchOps(SCALED_GROUPED).moe(x, logits, gate_up, down, 3, True)
        torch.testing.assert_close(blocks, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ layouts and tensor parallelism
@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
def test_fp8_experts_stored_stacked_load_as_the_per_expert_ones(sources, tmp_path, fmt):
    folder, _ = write_fp8(sources["qwen2_moe"], tmp_path / fmt, fmt)
    stacked = edit_checkpoint(folder, tmp_path / "stacked", stack_experts)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(str(stacked / "model.safetensors"))
    cfg = ModelConfig.from_pretrained(folder)
    want, got = (load_model(p, cfg, "cpu").state_dict() for p in (folder, stacked))
    assert want.keys() == got.keys() and all(_fp8_equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_a_rank_holds_its_columns_of_every_fp8_expert_and_their_block_scales(block, tmp_path, stacked):
    path = edit_checkpoint(block[0], tmp_path / "stacked", stack_experts) if stacked else block[0]
    cfg = ModelConfig.from_pretrained(path)
    whole = load_model(path, cfg, "cpu").model.layers[1].mlp
    for rank in (0, 1):
        part = load_model(path, cfg, "cpu", tp=TPGroup(ShardLayout.of(cfg, rank, 2))).model.layers[1].mlp
        mine = slice(128 * rank, 128 * rank + 128)  # this rank's 128 of each expert's 256 columns: a block
        gate_up, down, shared = (
            m.dequantize(torch.float32)
            for m in (whole.experts.gate_up_proj, whole.experts.down_proj, whole.shared_expert.down_proj)
        )
        want = gate_up.unflatten(1, (2, 256))[:, :, mine].flatten(1, 2)  # gate's rows, then up's
        assert torch.equal(part.experts.gate_up_proj.dequantize(torch.float32), want)
        assert torch.equal(part.experts.down_proj.dequantize(torch.float32), down[..., mine])
        assert torch.equal(part.shared_expert.down_proj.dequantize(torch.float32), shared[..., mine])
        rows = slice(rank, rank + 1)  # its block row of gate's two and of up's two
        want_scale = whole.experts.gate_up_proj.weight_scale.unflatten(1, (2, 2))[:, :, rows].flatten(1, 2)
        assert torch.equal(part.experts.gate_up_proj.weight_scale, want_scale)


# ------------------------------------------------------------------ bad checkpoints
def _fp8(name: str, shape: tuple[int, ...]):
    """An edit making ``name`` FP8 with its block scales."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(shape).to(FP8)
        t[name.removesuffix("weight") + "weight_scale_inv"] = torch.ones(1, 2)

    return edit


E = "model.layers.1.mlp.experts."


def _stacked_scale(t: dict[str, torch.Tensor]) -> None:
    stack_experts(t)
    t[E + "gate_up_proj_scale_inv"] = torch.ones(4, 4, 3)


UP = E + "2.up_proj.weight"
PER_BLOCK = r"one scale per 128x128 block of the"
BAD = {  # what the edit does: (the edit, the line)
    "scale-missing": (
        lambda t: t.pop(UP + "_scale_inv"),
        rf"^{UP}_scale_inv is missing: the scales of FP8 weight {UP} \(fp8 checkpoint, 128x128 blocks\)$",
    ),
    "scale-shape": (
        lambda t: t.update({E + "1.down_proj.weight_scale_inv": torch.ones(2, 3)}),
        rf"^{E}1.down_proj.weight_scale_inv: shape \(2, 3\), expected \(2, 2\): {PER_BLOCK} \(256, 256\) FP8",
    ),
    "stacked-scale-shape": (
        _stacked_scale,
        rf"^{E}gate_up_proj_scale_inv: shape \(4, 4, 3\), expected \(4, 4, 2\): {PER_BLOCK} \(4, 512, 256\)",
    ),
    "expert-missing": (
        lambda t: [t.pop(UP + k) for k in ("", "_scale_inv")],
        rf"^checkpoint lacks \['{UP}'\]$",
    ),
    "scale-alone": (lambda t: t.pop(UP), rf"^unexpected tensor '{UP}_scale_inv': no weight {UP} beside it$"),
    "mixed-parts": (
        lambda t: t.update({UP: torch.zeros(256, 256)}),
        rf"^{UP} is float32, but the other parts of model.layers.1.mlp.experts are FP8 ",
    ),
    "fp8-router": (
        _fp8("model.layers.1.mlp.gate.weight", (4, 256)),
        r"^model.layers.1.mlp.gate.weight is FP8: radixserve keeps an MoE router \(gate\) in high precision",
    ),
    "fp8-shared-expert-gate": (
        _fp8("model.layers.0.mlp.shared_expert_gate.weight", (1, 256)),
        r"^model.layers.0.mlp.shared_expert_gate.weight is FP8: .* router \(shared_expert_gate\)",
    ),
}


@pytest.mark.parametrize(("edit", "error"), list(BAD.values()), ids=list(BAD))
def test_a_bad_fp8_moe_checkpoint_is_refused_at_load_in_one_line_naming_the_tensor(
    block, tmp_path, edit, error
):
    path = edit_checkpoint(block[0], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=error) as err:
        load_model(path, ModelConfig.from_pretrained(path), "cpu")
    assert len(str(err.value).splitlines()) == 1


def test_mixtrals_fp8_router_is_refused_by_its_own_name(sources, tmp_path):
    folder, _ = write_fp8(sources["mixtral"], tmp_path / "block", "block")
    name = "model.layers.0.block_sparse_moe.gate.weight"
    path = edit_checkpoint(folder, tmp_path / "bad", _fp8(name, (4, 256)))
    with pytest.raises(ValueError, match=rf"^{name} is FP8: radixserve keeps an MoE router \(gate\)"):
        load_model(path, ModelConfig.from_pretrained(path), "cpu")


def test_a_per_channel_expert_scale_of_the_wrong_shape_is_refused_naming_it(sources, tmp_path):
    folder, _ = write_fp8(sources["qwen2_moe"], tmp_path / "channel", "channel")
    name = E + "0.down_proj.weight_scale"
    path = edit_checkpoint(folder, tmp_path / "bad", lambda t: t.update({name: torch.ones(255, 1)}))
    expected = r"expected \(256, 1\), \(256,\) or one value for the \(256, 256\) FP8 weight$"
    with pytest.raises(ValueError, match=rf"^{name}: shape \(255, 1\), {expected}"):
        load_model(path, ModelConfig.from_pretrained(path), "cpu")


def test_with_the_flag_a_high_precision_expert_is_quantized_into_its_stacks_blocks(block, tmp_path):
    up = E + "0.up_proj.weight"
    original = load_file(str(block[1] / "model.safetensors"))[up]  # the reference: dequantized float32
    path = edit_checkpoint(block[0], tmp_path / "mixed", lambda t: t.update({up: original}))
    model = load_model(path, ModelConfig.from_pretrained(path, quantization="fp8"), "cpu")
    stack = model.model.layers[1].mlp.experts.gate_up_proj  # its blocks: gate's from the checkpoint
    assert stack.layout == ScaleLayout((128, 128))
    got = stack.expert(0, torch.float32)[256:]
    assert ((got - original).abs() <= original.abs() / 16 + 1e-3).all()


def test_a_tensor_parallel_split_that_cuts_an_experts_block_is_refused_before_any_process_starts(
    block, tmp_path
):
    cfg = ModelConfig.from_pretrained(block[0])  # experts and shared expert 256 wide
    assert tp_problem(cfg, 2) is None  # 128 of each per rank: whole blocks
    a3b = replace(QWEN3_30B_A3B, quantization=BLOCKS)  # Qwen3-30B-A3B-FP8: experts 768 wide
    assert tp_problem(a3b, 2) is None
    assert tp_problem(a3b, 4) == (
        "tp_size 4 cuts the checkpoint's 128x128 FP8 blocks: 192 expert gate_proj/up_proj rows per rank"
        " (a multiple of 128 is needed)"
    )
    shared = replace(cfg, moe=replace(cfg.moe, shared_intermediate_size=384))
    assert "192 shared expert gate_proj/up_proj rows per rank" in (tp_problem(shared, 2) or "")
    path = tmp_path / "wide"
    shutil.copytree(block[0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 384}))
    with pytest.raises(ValueError, match=r"^tensor parallelism: tp_size 2 cuts .*: 192 expert gate_proj"):
        Engine(path, tp_size=2, device="cpu")
