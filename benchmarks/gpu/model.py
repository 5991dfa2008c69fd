"""The model under test (random weights, Qwen3-0.6B's shapes or tiny ones; ``--arch qwen3_moe``:
its mixture-of-experts counterpart) and the Engine that serves it with this run's device, dtype and
page size."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# Qwen3-0.6B's shapes (its config.json); the weights are random.
QWEN3_0_6B: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
)


# --arch qwen3_moe: Qwen3-0.6B's attention (and so the same flashinfer modules) with every MLP an
# MoE block of 64 experts, 8 per token, 384 wide: a token's active expert columns (8 x 384) match
# Qwen3-0.6B's MLP (3072) while a layer holds 8x its MLP weights (about 2.4B parameters in all).
QWEN3_MOE: dict[str, Any] = dict(
    QWEN3_0_6B,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=384,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
SHAPES_BY_ARCH = {"qwen3": QWEN3_0_6B, "qwen3_moe": QWEN3_MOE}


def build_model(path: Path, smoke: bool, dtype: str, seed: int, arch: str = "qwen3") -> Path:
    """A random-weight Qwen3 or Qwen3-MoE folder (the shapes above, or the tiny demo ones) with the
    demo tokenizer."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from radixserve.common.demo_model import model_config, save_random_model

    def config(vocab: int, ids: dict[str, Any]) -> Any:
        if smoke:  # the tiny demo model's shapes, vocab = the tokenizer's
            return model_config(arch, "tiny", vocab, ids, dtype)
        if arch == "qwen3_moe":
            return Qwen3MoeConfig(dtype=dtype, **QWEN3_MOE, **ids)
        return Qwen3Config(dtype=dtype, **QWEN3_0_6B, **ids)

    return save_random_model(path, config, dtype, seed)


def tokenizer_vocab(model_path: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(model_path)))


# ----------------------------------------------------------------------------- engine
def make_engine(model_path: Path, args: argparse.Namespace, **kw: Any):
    """An Engine with this run's device, dtype and page size; ``kw``: graphs, overlap, max_running,
    max_total_tokens."""
    from radixserve import Engine

    return Engine(
        str(model_path),
        device=args.device,
        dtype=args.dtype,
        disable_cuda_graph=not kw["graphs"],
        cuda_graph_max_bs=kw["max_running"],
        disable_overlap=not kw["overlap"],
        max_running_requests=kw["max_running"],
        page_size=args.page_size,
        max_total_tokens=kw["max_total_tokens"],
        chunked_prefill_size=args.chunked_prefill_size,
    )
