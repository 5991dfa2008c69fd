"""Real models' shapes for tests that count or size without weights."""

from __future__ import annotations

from dataclasses import replace

import torch

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.moe_config import MoEConfig

QWEN3_06B = ModelConfig(
    arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
    qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, tie_word_embeddings=True,
    max_position_embeddings=4096, dtype=torch.bfloat16, eos_token_ids=(0,),
)  # fmt: skip
# Qwen3-30B-A3B's per-layer shapes, 4 of its 48 layers (a layer's launches do not depend on how many)
QWEN3_30B_A3B = replace(
    QWEN3_06B, arch="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_layers=4, num_heads=32,
    num_kv_heads=4, tie_word_embeddings=False,
    moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=768, renormalize=True,
                  shared_intermediate_size=0, sparse_layers=(0, 1, 2, 3)),
)  # fmt: skip
