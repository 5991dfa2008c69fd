"""Llama / Qwen2 / Qwen3 decoder-only models over the paged KV pool: one implementation, config switches.

Module names mirror Hugging Face's so a checkpoint's tensors load by name, except two merged
projections: ``qkv_proj`` holds q_proj, k_proj and v_proj stacked (rows in that order) and
``gate_up_proj`` holds gate_proj then up_proj; the loader (model/loader.py) concatenates them. One
matmul instead of three (two) per layer, and the outputs are the same numbers.

Between matmuls the layers call only the five ops of ``self.ops`` (model/ops.py: torch on every
device, flashinfer's fused kernels on CUDA); attention goes through an AttentionBackend
(model/attention/): the model never sees the KV layout. The residual stream is carried beside the
hidden state so that "add the residual, then normalise" is one fused op (HF's order of operations).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.model.attention import AttentionBackend
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.ops import Ops, RopeInputs, TorchOps, cos_sin_table
from radixserve.scheduler.model.rope import inv_frequencies


@dataclass(slots=True)
class StepContext:
    """What every layer of one forward needs besides its hidden state."""

    fb: ForwardBatch
    backend: AttentionBackend
    ops: Ops
    rope: RopeInputs  # ops.rope_inputs(...) of this forward's positions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops, residual: torch.Tensor | None = None):
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's q and k before the rotation
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q, ctx.ops), self.k_norm(k, ctx.ops)
        q, k = ctx.ops.rope(q, k, ctx.rope)
        return self.o_proj(ctx.backend.forward(self.layer_id, q, k, v, ctx.fb))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous layer's output and the residual stream before it was added (None at
        the first layer); returns this layer's MLP output and the residual stream before it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x, ctx.ops)
        else:
            x, residual = self.input_layernorm(x, ctx.ops, residual)
        x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, ctx.ops, residual)
        return self.mlp(x, ctx.ops), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.ops: Ops = TorchOps()
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)build the rotary table (float32 whatever the model's dtype): at init and after loading,
        since building the model on the meta device leaves buffers empty."""
        cfg = self.config
        inv = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        device = self.model.embed_tokens.weight.device
        if device.type == "meta":
            self.cos_sin = torch.empty(self.max_positions, cfg.head_dim, device="meta")
        else:
            self.cos_sin = cos_sin_table(inv.to(device), self.max_positions)

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        """Logits of each request's last token, [B, vocab] (every token's with ``fb.all_logits``)."""
        x = self.model.embed_tokens(input_ids)
        ctx = StepContext(fb, backend, self.ops, self.ops.rope_inputs(positions, self.cos_sin, x.dtype))
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx)
        assert residual is not None
        if not fb.all_logits and fb.mode is not ForwardMode.DECODE:  # decode: one token per request
            last = fb.last_index
            if last is None:  # built by ModelRunner.prepare; computed here only for direct callers
                last = torch.from_numpy(np.cumsum(fb.extend_lens) - 1).to(x.device)
            x, residual = x.index_select(0, last), residual.index_select(0, last)
        x, _ = self.model.norm(x, self.ops, residual)
        return F.linear(x, self.output_weight()).float()
