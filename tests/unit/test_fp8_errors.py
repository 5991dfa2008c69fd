"""What cannot be served fails at load, in one line naming it; FP8 under tensor parallelism.

Quantizations other than FP8 (their quantization_config as the tools write it), an architecture we
do not serve, FP8 scales missing or of the wrong shape, FP8 tensors without a quantization_config,
and tensor-parallel splits that cut a 128x128 block are refused before anything serves. A split on
whole blocks is served: tests/integration/test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from radixserve import Engine
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.parallel import tp_problem
from tests.helpers.fp8_models import edit_checkpoint, source_model, write_fp8

# quant_method and the fields that say what it is, as each tool writes them
UNSERVED = {
    "awq": (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
        "awq",
    ),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "gptq"),
    "mxfp4": ({"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}, "mxfp4"),
    "nvfp4 modelopt": (
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
        "modelopt NVFP4",
    ),
    "nvfp4 compressed-tensors": (
        {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
        "'nvfp4-pack-quantized'",
    ),
    "w4a16 compressed-tensors": (
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
        "'pack-quantized'",
    ),
    "bitsandbytes": (
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        "bitsandbytes",
    ),
}


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    """(the block-format FP8 folder, its reference folder)."""
    root = tmp_path_factory.mktemp("fp8-errors")
    return write_fp8(source_model(root / "src", "qwen3"), root / "block", "block")


def _config_variant(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


@pytest.mark.parametrize("kind", sorted(UNSERVED))
def test_an_unserved_quantization_is_refused_in_one_line_listing_what_is_served(block, tmp_path, kind):
    config, named = UNSERVED[kind]
    path = _config_variant(block[1], tmp_path / "m", quantization_config=config)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_pretrained(path)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and named in message, message
    assert "served: fp8 (128x128 blocks or per tensor), compressed-tensors" in message


def test_an_unserved_architecture_is_refused_in_one_line_listing_what_is_served(block, tmp_path):
    path = _config_variant(block[1], tmp_path / "m", architectures=["MambaForCausalLM"])
    with pytest.raises(
        ValueError, match=r"^unsupported architecture \['MambaForCausalLM'\]; supported: .*Qwen3"
    ):
        ModelConfig.from_pretrained(path)


SCALE = "model.layers.1.self_attn.k_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("edit", "config", "error"),
    [
        (lambda t: t.pop(SCALE), None, f"^{SCALE} is missing: the scales of FP8 weight .*k_proj.weight"),
        (
            lambda t: t.update({SCALE: torch.ones(1, 2)}),
            None,
            rf"^{SCALE}: shape \(1, 2\), expected \(2, 2\): one scale per 128x128 block of the \(256, 256\)",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(4, 2, 1)}),
            None,
            r"^model.layers.0.mlp.up_proj.weight_scale_inv: shape \(4, 2, 1\), expected \(4, 2\)",
        ),
        (
            lambda t: None,
            {"quantization_config": None},
            r"^model.layers.0.mlp.down_proj.weight is FP8, but .* no q",
        ),
        (
            lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)}),
            {"tie_word_embeddings": False},
            "^lm_head.weight is FP8: radixserve serves FP8 in the decoder layers' linear projections",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].float()}
            ),
            None,
            "^model.layers.0.mlp.up_proj.weight is float32, but the other parts of .*gate_up_proj are FP8",
        ),
    ],
    ids=[
        "scale-missing",
        "scale-shape",
        "scale-rank",
        "no-quantization-config",
        "fp8-lm-head",
        "mixed-parts",
    ],
)
def test_a_bad_fp8_checkpoint_is_refused_at_load_naming_the_tensor(block, tmp_path, edit, config, error):
    path = edit_checkpoint(block[0], tmp_path / "bad", edit, config)
    with pytest.raises(ValueError, match=error) as err:
        load_model(path, ModelConfig.from_pretrained(path), "cpu")
    assert len(str(err.value).splitlines()) == 1


def test_with_the_flag_a_high_precision_part_of_an_fp8_projection_is_quantized_into_its_blocks(
    block, tmp_path
):
    up = "model.layers.0.mlp.up_proj.weight"
    original = load_file(str(block[1] / "model.safetensors"))[up]  # the reference: dequantized float32
    path = edit_checkpoint(block[0], tmp_path / "mixed", lambda t: t.update({up: original}))
    model = load_model(path, ModelConfig.from_pretrained(path, quantization="fp8"), "cpu")
    merged = model.model.layers[0].mlp.gate_up_proj  # gate rows from the checkpoint, up rows quantized here
    got = merged.dequantize(torch.float32)[512:]
    assert ((got - original).abs() <= original.abs() / 16 + 1e-3).all()


def test_a_tensor_parallel_split_that_cuts_a_block_is_refused_before_any_process_starts(block, tmp_path):
    cfg = ModelConfig.from_pretrained(block[0])  # 2 heads and 2 KV heads of 128, MLP 512
    assert tp_problem(cfg, 2) is None  # 128 q/k/v rows, 256 MLP rows per rank: whole blocks
    assert tp_problem(cfg, 4) == "tp_size 4 does not divide the model's 2 attention heads"
    narrow = replace(cfg, num_heads=4, num_kv_heads=2, head_dim=64)  # 64 k/v rows per rank at tp 2
    assert tp_problem(narrow, 2) == (
        "tp_size 2 cuts the checkpoint's 128x128 FP8 blocks: 64 k_proj/v_proj rows per rank"
        " (a multiple of 128 is needed)"
    )
    mlp = replace(cfg, intermediate_size=768)  # Qwen3-30B-A3B's experts at tp 4: 192 per rank
    assert "192 gate_proj/up_proj rows per rank" in (
        tp_problem(replace(mlp, num_heads=4, num_kv_heads=4), 4) or ""
    )
    path = _config_variant(block[0], tmp_path / "narrow", num_attention_heads=4, head_dim=64)
    with pytest.raises(ValueError, match=r"^tensor parallelism: tp_size 2 cuts the checkpoint's 128x128 FP8"):
        Engine(path, tp_size=2, device="cpu")
