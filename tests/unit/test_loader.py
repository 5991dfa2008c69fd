"""The loader merges a checkpoint's q/k/v and gate/up tensors into our merged projections, row by
row, and refuses a checkpoint with a part missing, twice, or unknown."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.loader import load_model


@pytest.fixture(scope="module")
def qwen2_dir(demo_model):  # qwen2: q/k/v carry biases too
    return demo_model("qwen2")


def test_merged_rows_are_the_checkpoint_parts_in_order(qwen2_dir):
    cfg = ModelConfig.from_pretrained(qwen2_dir)
    model = load_model(qwen2_dir, cfg, "cpu")
    ckpt = load_file(str(qwen2_dir / "model.safetensors"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    for kind in ("weight", "bias"):
        want = torch.cat([ckpt[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv"])
        assert torch.equal(getattr(attn.qkv_proj, kind), want)
    want = torch.cat([ckpt[f"{p}mlp.gate_proj.weight"], ckpt[f"{p}mlp.up_proj.weight"]])
    assert torch.equal(mlp.gate_up_proj.weight, want)


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"), "lacks .*qkv_proj.weight"),
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "lacks .*gate_up_proj.weight"),
        (lambda t: t.update({"model.layers.0.self_attn.z_proj.weight": torch.zeros(1)}), "unexpected tensor"),
    ],
    ids=["missing-k", "missing-up", "unknown"],
)
def test_a_broken_checkpoint_is_refused_by_name(qwen2_dir, tmp_path, edit, error):
    tensors = load_file(str(qwen2_dir / "model.safetensors"))
    edit(tensors)
    for f in qwen2_dir.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=error):
        load_model(tmp_path, cfg, "cpu")
