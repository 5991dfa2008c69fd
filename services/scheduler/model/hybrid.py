"""The hybrid decoders: Qwen3-Next (``Qwen3NextForCausalLM``), Qwen3.5 (``Qwen3_5ForCausalLM``) and
Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``). ``layer_types`` (model/hybrid_config.py) makes each layer a
Gated DeltaNet layer (model/linear_attention.py: a recurrent state, no KV) or a gated full-attention
layer over the paged KV pool; the MLP is the dense one or the MoE block, as for the other models
(model/llama.py ``feed_forward``). Everything else is llama.py's decoder: the embedding, the residual
stream, the LM head, tensor parallelism, what a forward returns.

What the full-attention layers add to Qwen3's: ``q_proj`` gives each head its query and an output
gate side by side (``[q_h | gate_h]`` per head), the attention output is multiplied by
``sigmoid(gate)`` before ``o_proj``; RoPE turns the first ``rotary_dim`` features of each head. The
KV pool holds only these layers, indexed by their order among them (``kv_layer``).

Every RMSNorm here but the linear layers' gated one stores ``w - 1`` (``norm(x) * (1 + w)``):
``OffsetRMSNorm`` calls the ops' offset variants, which compute it as HF does.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.hybrid_config import LINEAR
from radixserve.scheduler.model.linear_attention import GatedDeltaNet
from radixserve.scheduler.model.llama import (
    Backbone,
    CausalLM,
    RMSNorm,
    StepContext,
    feed_forward,
    row_linear,
)
from radixserve.scheduler.model.parallel import TPGroup


class OffsetRMSNorm(RMSNorm):
    """RMSNorm with its weight stored as ``w - 1`` (initialised to zeros in HF)."""

    offset = True


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer: int, tp: TPGroup | None = None) -> None:
        """``cfg``: this rank's; ``kv_layer``: this layer's index in the KV pool."""
        super().__init__()
        self.kv_layer = kv_layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = 2 * cfg.num_heads * cfg.head_dim  # query and output gate
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = row_linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:]
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        q, k = self.q_norm(q, ctx.ops), self.k_norm(k, ctx.ops)
        q, k = ctx.ops.rope(q, k, ctx.rope)
        out = ctx.backend.forward(self.kv_layer, q, k, v, ctx.fb) * torch.sigmoid(gate.reshape(t, -1))
        y: torch.Tensor = self.o_proj(out)
        return y


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        h = cfg.hybrid
        assert h is not None
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear = h.layer_types[layer_id] == LINEAR
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, h.linear_layers.index(layer_id), tp)
        else:
            self.self_attn = GatedAttention(cfg, h.full_layers.index(layer_id), tp)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, layer_id, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.py's DecoderLayer: the layer's MLP output and the residual stream before it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x, ctx.ops)
        else:
            x, residual = self.input_layernorm(x, ctx.ops, residual)
        x = self.linear_attn(x, ctx.fb) if self.linear else self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, ctx.ops, residual)
        return self.mlp(x, ctx.ops), residual


class HybridCausalLM(CausalLM):
    def backbone(self, cfg: ModelConfig) -> Backbone:
        return Backbone(cfg, self.layout, self.tp, layer=HybridDecoderLayer, norm=OffsetRMSNorm)


def causal_lm(cfg: ModelConfig, max_positions: int | None = None, tp: TPGroup | None = None) -> CausalLM:
    """The model class ``cfg`` needs (the loader builds it on the meta device)."""
    cls = CausalLM if cfg.hybrid is None else HybridCausalLM
    return cls(cfg, max_positions, tp)
