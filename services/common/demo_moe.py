"""Mixture-of-experts demo models: the dense demo model's shapes (demo_model.SHAPES) with MoE layers.

``make_demo_model(path, arch=...)`` builds these for the three MoE architectures served, with
random weights like the dense ones:

* ``qwen3_moe``: ``Qwen3MoeForCausalLM``, top-k weights renormalised (``norm_topk_prob``); the tiny
  one keeps layer 0 dense (``mlp_only_layers``), so dense and sparse layers mix;
* ``qwen2_moe``: ``Qwen2MoeForCausalLM``, every layer sparse, with the shared expert and its sigmoid
  gate, top-k weights not renormalised (Qwen1.5-MoE's setting);
* ``mixtral``: ``MixtralForCausalLM``, every layer sparse, each expert ``expert_width`` wide.

Experts per size: "tiny" (tests) has 4 experts, 2 per token, 32 wide (a shared expert of 64);
"small" (CPU benchmarks) has 16 experts, 4 per token, 384 wide, so a token's active expert
columns (4 x 384) match the dense small model's MLP (1536) while the layer holds 4x its weights.
Embeddings are untied (as in the released MoE checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


class MoEShape(TypedDict):
    num_experts: int
    experts_per_token: int
    expert_width: int
    shared_width: int  # Qwen2-MoE's shared expert
    dense_layers: list[int]  # Qwen3-MoE's mlp_only_layers


MOE_SHAPES: dict[str, MoEShape] = {
    "tiny": MoEShape(num_experts=4, experts_per_token=2, expert_width=32, shared_width=64, dense_layers=[0]),
    "small": MoEShape(
        num_experts=16, experts_per_token=4, expert_width=384, shared_width=768, dense_layers=[]
    ),
}


def moe_model_config(arch: str, size: str, common: dict[str, Any], ids: dict[str, Any]) -> PretrainedConfig:
    """The transformers config of MoE demo model ``arch`` / ``size``; ``common``: the dense demo
    model's config arguments of that size (shapes, vocabulary, dtype), ``ids``: special token ids."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    moe = MOE_SHAPES[size]
    args = {**common, **ids, "tie_word_embeddings": False}
    args["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    top_k, experts, width = moe["experts_per_token"], moe["num_experts"], moe["expert_width"]
    if arch == "mixtral":
        args["intermediate_size"] = width
        return MixtralConfig(num_local_experts=experts, num_experts_per_tok=top_k, **args)
    qwen: dict[str, Any] = dict(
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width, decoder_sparse_step=1
    )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(norm_topk_prob=True, mlp_only_layers=moe["dense_layers"], **qwen, **args)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            norm_topk_prob=False, shared_expert_intermediate_size=moe["shared_width"], **qwen, **args
        )
    raise ValueError(f"unknown MoE arch {arch!r}; expected one of {MOE_ARCHS}")
