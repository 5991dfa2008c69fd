"""Tiny FP8 checkpoints, written as the quantization tools write them, and their reference folders.

Each format quantizes a random-weight model's linear projections (q/k/v/o, gate/up/down) with its
own arithmetic here, independent of radixserve's (model/quant/fp8.py):

* ``block``: the official Qwen / DeepSeek "fp8" checkpoints: an e4m3 weight and a float32
  ``weight_scale_inv`` per 128x128 block (``quant_method: fp8``, ``weight_block_size``);
* ``channel``: llm-compressor's compressed-tensors FP8_DYNAMIC: a ``weight_scale`` [N, 1] per output
  channel, stored in bfloat16 as llm-compressor stores it, and the ``ignore`` list leaving one
  projection in high precision;
* ``tensor``: per-tensor FP8 (``quant_method: fp8`` without blocks, static activations as AutoFP8
  wrote them): a scalar ``weight_scale`` and a scalar ``input_scale`` per projection;
* ``load``: no FP8 folder (``--quantization fp8`` quantizes the source model while loading), only
  the reference: per output row, float32 scales.

The reference folder beside each holds the same model with every projection dequantized in float32
(``weight * scale``) and no quantization_config: what HF transformers runs.

Shapes are multiples of 128 (the blocks) and split in two on whole blocks (tensor parallelism):
hidden 256, 2 heads and 2 KV heads of 128, MLP 512, 4 layers. The mixture-of-experts architectures
(qwen3_moe, qwen2_moe, mixtral: demo_moe.py's tiny ones, 4 experts, 2 per token) get experts 256
wide (``MOE_SHAPE``; Qwen2-MoE's shared expert too): every expert tensor (``mlp.experts.{e}.*_proj``,
Mixtral's ``w1``/``w3``/``w2``) is quantized like a projection, the routers are not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from radixserve.common.demo_model import model_config, save_random_model

FP8 = torch.float8_e4m3fn
SHAPE = dict(
    hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
    intermediate_size=512, num_hidden_layers=4, initializer_range=0.1,
)  # fmt: skip
MOE_SHAPE = {
    "qwen3_moe": dict(moe_intermediate_size=256),
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256),
    "mixtral": dict(intermediate_size=256),  # Mixtral's experts are intermediate_size wide
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
IGNORED = "model.layers.3.mlp.down_proj"  # the channel format's llm-compressor ignore entry

CONFIGS: dict[str, dict[str, Any]] = {
    "block": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"],
    },
    "channel": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                    "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax",
                },
                "input_activations": {
                    "num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                    "dynamic": True, "group_size": None, "block_structure": None, "observer": None,
                },
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", f"re:.*{IGNORED.removeprefix('model.')}$"],
        "kv_cache_scheme": None,
    },
    "tensor": {"quant_method": "fp8", "activation_scheme": "static"},
}  # fmt: skip


def source_model(path: Path, arch: str) -> Path:
    """A random-weight HF folder of ``arch`` at the shapes above (float32)."""

    def make(vocab: int, ids: dict[str, Any]) -> Any:
        tiny = model_config(arch, "tiny", vocab, ids).to_dict()
        tiny.pop("layer_types", None)  # derived from the layer count: rebuilt for ours
        return AutoConfig.for_model(**{**tiny, **SHAPE, **MOE_SHAPE.get(arch, {})})

    return save_random_model(path, make)


def quantize(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The tensors a tool writes for weight ``w`` (suffixes after the module name's dot)."""
    if fmt == "block":
        q, scale = torch.empty_like(w, dtype=FP8), torch.empty(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        for i in range(0, w.shape[0], 128):
            for j in range(0, w.shape[1], 128):
                s = w[i : i + 128, j : j + 128].abs().max() / 448
                q[i : i + 128, j : j + 128] = (w[i : i + 128, j : j + 128] / s).to(FP8)
                scale[i // 128, j // 128] = s
        return {"weight": q, "weight_scale_inv": scale}
    if fmt in ("channel", "load"):  # llm-compressor stores its scales in bfloat16; load: float32
        scale = (w.abs().amax(dim=1, keepdim=True) / 448).to(torch.bfloat16 if fmt == "channel" else w.dtype)
        return {"weight": (w / scale.float()).clamp(-448, 448).to(FP8), "weight_scale": scale}
    s = w.abs().max() / 448
    return {"weight": (w / s).to(FP8), "weight_scale": s.reshape(()), "input_scale": torch.tensor(1.0)}


def dequantized(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the tool's tensors stand for, in float32."""
    q = parts["weight"].float()
    if "weight_scale_inv" in parts:
        s = parts["weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
        return q * s[: q.shape[0], : q.shape[1]]
    return (
        q * parts["weight_scale"].float().reshape(-1, 1)
        if parts["weight_scale"].dim()
        else q * parts["weight_scale"]
    )


def write_fp8(src: Path, dst: Path, fmt: str) -> tuple[Path, Path]:
    """(the FP8 folder, the reference folder) of model ``src`` in format ``fmt``; ``load``: the
    reference of what ``--quantization fp8`` makes of ``src`` (per output row, float32 scales), whose
    FP8 folder is ``src`` itself."""
    tensors = load_file(str(src / "model.safetensors"))
    quantized, reference = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if (
            not name.endswith(".weight")
            or module.rpartition(".")[2] not in PROJECTIONS
            or (module == IGNORED and fmt == "channel")
        ):
            quantized[name] = reference[name] = w
            continue
        parts = quantize(w, fmt)
        quantized.update({f"{module}.{k}": v for k, v in parts.items()})
        reference[name] = dequantized(parts)
    ref = dst.with_name(dst.name + "-reference")
    written = [(ref, reference, None)] + ([(dst, quantized, CONFIGS[fmt])] if fmt in CONFIGS else [])
    for folder, state, quant in written:
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(state, str(folder / "model.safetensors"))
        if quant is not None:
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(
                json.dumps({**config, "quantization_config": quant}, indent=2)
            )
    return (dst if fmt in CONFIGS else src), ref


def edit_checkpoint(src: Path, dst: Path, edit: Any, config: dict[str, Any] | None = None) -> Path:
    """A copy of folder ``src`` with ``edit(tensors)`` applied and ``config`` merged into config.json."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    if config is not None:
        merged = {**json.loads((dst / "config.json").read_text()), **config}
        (dst / "config.json").write_text(json.dumps(merged, indent=2))
    return dst


def _fp8_tensors(ref: Path, fmt: str):
    """Each tensor of reference folder ``ref`` and, if ``fmt`` holds it in FP8, its bytes there:
    1 a parameter plus float32 scales (blocks: one per 128x128; else one per row, the merged
    q/k/v and gate/up and the stacked experts included); None: kept in high precision."""
    for name, t in load_file(str(ref / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        fp8 = name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS
        if not fp8 or (fmt == "channel" and module == IGNORED):
            yield t, None
            continue
        blocks = -(-t.shape[0] // 128) * -(-t.shape[1] // 128)
        yield t, t.numel() + 4 * (blocks if fmt == "block" else t.shape[0])


def expected_bytes(ref, fmt: str, dtype_bytes: int) -> tuple[int, int]:
    """(the FP8 model's weight bytes, its projections' bytes in bf16) from the reference tensors:
    FP8 projections (and experts) as ``_fp8_tensors`` says, everything else at ``dtype_bytes``."""
    total = bf16 = 0
    for t, fp8 in _fp8_tensors(ref, fmt):
        total += t.numel() * dtype_bytes if fp8 is None else fp8
        bf16 += 0 if fp8 is None else 2 * t.numel()
    return total, bf16


def projection_bytes(ref, fmt: str) -> tuple[int, int]:
    """(the FP8 projections' (and experts') bytes with their scales, the same in bf16)."""
    fp8 = [(size, 2 * t.numel()) for t, size in _fp8_tensors(ref, fmt) if size is not None]
    return sum(f for f, _ in fp8), sum(b for _, b in fp8)
