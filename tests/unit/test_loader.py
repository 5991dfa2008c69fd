"""The loader merges a checkpoint's q/k/v and gate/up tensors into our merged projections, row by
row, stacks a mixture-of-experts checkpoint's experts into one tensor per layer and projection, and
refuses a checkpoint with a part missing, twice, unknown or of the wrong shape, in one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.expert_weights import moe_placement
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.parallel import ShardLayout
from tests.helpers.moe_checkpoints import stack_experts


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
    rewrite(qwen2_dir, tmp_path, edit)
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=error):
        load_model(tmp_path, cfg, "cpu")


def rewrite(src: Path, dst: Path, edit) -> Path:
    """``src``'s folder copied to ``dst`` with its tensors changed by ``edit(tensors)``."""
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


# ----------------------------------------------------------------------- mixture of experts
@pytest.fixture(scope="module")
def qwen2_moe_dir(demo_model):  # every layer sparse, with a shared expert
    return demo_model("qwen2_moe")


@pytest.fixture(scope="module")
def mixtral_dir(demo_model):  # block_sparse_moe.experts.{e}.w1 / w3 / w2
    return demo_model("mixtral")


@pytest.mark.parametrize(
    ("arch", "gate", "up", "down"),
    [("qwen2_moe", "gate_proj", "up_proj", "down_proj"), ("mixtral", "w1", "w3", "w2")],
)
def test_each_experts_tensors_fill_its_place_in_the_layers_stacks(request, arch, gate, up, down):
    path = request.getfixturevalue(f"{arch}_dir")
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu")
    ckpt = load_file(str(path / "model.safetensors"))
    block = "mlp" if arch != "mixtral" else "block_sparse_moe"
    moe = model.model.layers[1].mlp
    for e in range(4):
        gate_e, up_e, down_e = (
            ckpt[f"model.layers.1.{block}.experts.{e}.{p}.weight"] for p in (gate, up, down)
        )
        assert torch.equal(moe.experts.gate_up_proj[e], torch.cat([gate_e, up_e]))
        assert torch.equal(moe.experts.down_proj[e], down_e)
    assert torch.equal(moe.gate.weight, ckpt[f"model.layers.1.{block}.gate.weight"])
    if arch == "qwen2_moe":
        shared = [ckpt[f"model.layers.1.mlp.shared_expert.{p}_proj.weight"] for p in ("gate", "up")]
        assert torch.equal(moe.shared_expert.gate_up_proj.weight, torch.cat(shared))


def test_experts_stored_stacked_load_as_the_same_model(qwen2_moe_dir, tmp_path):
    stacked = rewrite(qwen2_moe_dir, tmp_path, stack_experts)
    cfg = ModelConfig.from_pretrained(qwen2_moe_dir)
    want, got = (
        load_model(qwen2_moe_dir, cfg, "cpu").state_dict(),
        load_model(stacked, cfg, "cpu").state_dict(),
    )
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_a_rank_reads_its_columns_of_every_expert(qwen2_moe_dir, tmp_path, stacked):
    path = rewrite(qwen2_moe_dir, tmp_path, stack_experts) if stacked else qwen2_moe_dir
    cfg = ModelConfig.from_pretrained(path)
    whole = load_model(qwen2_moe_dir, cfg, "cpu").model.layers[0].mlp
    for rank in (0, 1):
        layout = ShardLayout.of(cfg, rank, 2)
        mine = slice(16 * rank, 16 * rank + 16)  # this rank's 16 of each expert's 32 columns
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                placed = moe_placement(name, cfg, layout)
                if placed is None or not name.startswith("model.layers.0.mlp.experts"):
                    continue
                part = placed.read(name, f.get_slice(name))
                if "down" in name:
                    want = whole.experts.down_proj[..., mine]
                else:
                    gate_up = whole.experts.gate_up_proj
                    want = torch.cat(
                        [gate_up[..., :32, :][..., mine, :], gate_up[..., 32:, :][..., mine, :]], -2
                    )
                if not stacked:  # one expert's: gate rows, up rows or down columns
                    e = int(name.split(".experts.")[1].split(".")[0])
                    want = want[e] if "down" in name else want[e].chunk(2)["up" in name]
                assert torch.equal(part, want), name


def _set(name: str, shape: tuple[int, ...]):
    return lambda t: t.update({name: torch.zeros(shape)})


@pytest.mark.parametrize(
    ("arch", "edit", "error"),
    [
        ("qwen2_moe", lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
         r"lacks \['model.layers.1.mlp.experts.3.up_proj.weight'\]"),
        ("mixtral", lambda t: t.pop("model.layers.0.block_sparse_moe.experts.2.w2.weight"),
         r"lacks \['model.layers.0.block_sparse_moe.experts.2.w2.weight'\]"),
        ("qwen2_moe", _set("model.layers.1.mlp.experts.4.gate_proj.weight", (32, 64)),
         "unexpected tensor 'model.layers.1.mlp.experts.4.gate_proj.weight'"),
        ("qwen2_moe", _set("model.layers.1.mlp.experts.0.down_proj.weight", (64, 31)),
         r"model.layers.1.mlp.experts.0.down_proj.weight: checkpoint shape \(64, 31\) != \(64, 32\)"),
        ("qwen2_moe", _set("model.layers.1.mlp.experts.gate_up_proj", (4, 66, 64)),
         r"model.layers.1.mlp.experts.gate_up_proj: checkpoint shape \(4, 66, 64\) != \(4, 64, 64\)"),
        ("qwen2_moe", _set("model.layers.1.mlp.experts.gate_up_proj", (4, 64, 64)),
         "model.layers.1.mlp.experts.gate_up_proj: .* given twice"),
    ],
    ids=["missing-expert", "missing-mixtral-expert", "unknown-expert", "expert-shape", "stack-shape", "2x"],
)  # fmt: skip
def test_a_broken_moe_checkpoint_is_refused_in_one_line_naming_the_tensor(
    request, tmp_path, arch, edit, error
):
    path = rewrite(request.getfixturevalue(f"{arch}_dir"), tmp_path, edit)
    with pytest.raises(ValueError, match=error) as e:
        load_model(path, ModelConfig.from_pretrained(path), "cpu")
    assert "\n" not in str(e.value)


def test_an_architecture_not_served_is_refused_listing_those_that_are(qwen2_moe_dir, tmp_path):
    path = rewrite(qwen2_moe_dir, tmp_path, lambda t: None)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(
        ValueError, match=r"unsupported architecture \['DeepseekV3ForCausalLM'\]; supported: "
    ) as e:
        ModelConfig.from_pretrained(path)
    assert "MixtralForCausalLM" in str(e.value) and "Qwen3MoeForCausalLM" in str(e.value)
    assert "\n" not in str(e.value)
