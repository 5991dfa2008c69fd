"""Hybrid demo models: Gated DeltaNet layers and gated full attention, 3:1, random weights.

``make_demo_model(path, arch=...)`` builds these for the three hybrid architectures served:

* ``qwen3_5``: ``Qwen3_5ForCausalLM``, dense MLPs;
* ``qwen3_next``: ``Qwen3NextForCausalLM``, MoE MLPs with a shared expert (the tiny one keeps
  layer 0 dense, so dense and sparse layers mix), its input projections grouped per key head;
* ``qwen3_5_moe``: ``Qwen3_5MoeForCausalLM``, every MLP an MoE block with a shared expert.

Shapes: the dense demo model's (demo_model.SHAPES) for the full-attention layers and MLPs, with
``partial_rotary_factor`` 0.25 as the released checkpoints have; per size the linear layers'
heads below and demo_moe.MOE_SHAPES' experts. Layers 0-2 are linear attention and layer 3 full
(the small one repeats that twice). HF initialises the norms that compute ``x * (1 + w)`` to zero
and the gated norm to one; ``perturb`` moves them off those values so the tests see the offsets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

from radixserve.common.demo_moe import MOE_SHAPES

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

HYBRID_ARCHS = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


class LinearShape(TypedDict):
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int


LINEAR_SHAPES: dict[str, LinearShape] = {
    "tiny": LinearShape(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    ),
    "small": LinearShape(
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
    ),
}


def hybrid_model_config(
    arch: str, size: str, common: dict[str, Any], ids: dict[str, Any]
) -> PretrainedConfig:
    """The transformers config of hybrid demo model ``arch`` / ``size``; ``common``: the dense demo
    model's config arguments of that size, ``ids``: special token ids."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    layers = common["num_hidden_layers"] * 2  # 4 (tiny) or 16 (small): three linear, one full
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25}
    args = {**common, **ids, **LINEAR_SHAPES[size], "num_hidden_layers": layers, "layer_types": types}
    args.update(tie_word_embeddings=False, rope_parameters=rope)
    moe = MOE_SHAPES[size]
    experts: dict[str, Any] = dict(
        num_experts=moe["num_experts"],
        num_experts_per_tok=moe["experts_per_token"],
        moe_intermediate_size=moe["expert_width"],
        shared_expert_intermediate_size=moe["shared_width"],
    )
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**args)
    if arch == "qwen3_next":
        return Qwen3NextConfig(mlp_only_layers=moe["dense_layers"], norm_topk_prob=True, **experts, **args)
    if arch == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(**experts, **args)
    raise ValueError(f"unknown hybrid arch {arch!r}; expected one of {HYBRID_ARCHS}")


def perturb(model: nn.Module) -> None:
    """Move the norms off HF's initial values (offset norms 0, gated norms 1) and spread the linear
    layers' decay parameters, in place, from torch's (seeded) generator."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
