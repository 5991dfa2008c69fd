"""Real models' shapes for tests that count or size without weights."""

from __future__ import annotations

import torch

from radixserve.scheduler.model.config import ModelConfig

QWEN3_06B = ModelConfig(
    arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
    qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, tie_word_embeddings=True,
    max_position_embeddings=4096, dtype=torch.bfloat16, eos_token_ids=(0,),
)  # fmt: skip
