"""Llama / Qwen2 / Qwen3 decoder-only models over the paged KV pool: one implementation, config switches.
Their mixture-of-experts versions (Qwen3-MoE, Qwen2-MoE, Mixtral) are the same decoder with the MoE
block of model/moe.py in place of the MLP on their sparse layers.

Module names mirror Hugging Face's so a checkpoint's tensors load by name, except two merged
projections: ``qkv_proj`` holds q_proj, k_proj and v_proj stacked (rows in that order) and
``gate_up_proj`` holds gate_proj then up_proj; the loader (model/loader.py) concatenates them. One
matmul instead of three (two) per layer, and the outputs are the same numbers.

Between matmuls the layers call only the six ops of ``self.ops`` (model/ops.py: torch on every
device, flashinfer's fused kernels on CUDA); attention goes through an AttentionBackend
(model/attention/): the model never sees the KV layout. The residual stream is carried beside the
hidden state so that "add the residual, then normalise" is one fused op (HF's order of operations).

Tensor parallelism (model/parallel.py): with a ``TPGroup`` the layers hold this rank's slice
(``ShardLayout.local_config``: its heads and MLP columns), ``o_proj`` / ``down_proj`` are
``RowParallelLinear`` (all-reduce, then the bias), the embedding is ``VocabParallelEmbedding`` and
the logits are all-gathered: every rank returns the whole ``[B, vocab]``. Without one (tp_size 1)
the modules are plain ``nn.Linear`` / ``nn.Embedding``: not one op more than before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, overload

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.model.attention import AttentionBackend
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.logits import PromptScores
from radixserve.scheduler.model.moe import SparseMoE
from radixserve.scheduler.model.ops import Ops, RopeInputs, TorchOps, cos_sin_table
from radixserve.scheduler.model.parallel import ShardLayout, TPGroup
from radixserve.scheduler.model.rope import inv_frequencies


@dataclass(slots=True)
class StepContext:
    """What every layer of one forward needs besides its hidden state."""

    fb: ForwardBatch
    backend: AttentionBackend
    ops: Ops
    rope: RopeInputs  # ops.rope_inputs(...) of this forward's positions


class RMSNorm(nn.Module):
    offset = False  # OffsetRMSNorm: the weight stored as ``w - 1``

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, ops: Ops, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, ops: Ops, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, ops: Ops, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if self.offset:  # the weight is stored as ``w - 1`` (hybrid models)
            if residual is None:
                return ops.rms_norm_offset(x, self.weight, self.eps)
            return ops.add_rms_norm_offset(x, residual, self.weight, self.eps)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class RowParallelLinear(nn.Module):
    """``x @ W.T`` where each rank holds some of W's input columns (and x's matching features):
    the partial sums are all-reduced, then the bias (held whole by every rank) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds ``rows`` vocabulary rows from ``start``; a token's row lives on one rank, so
    the others contribute zeros and an all-reduce assembles the embedding."""

    def __init__(self, rows: int, dim: int, start: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.rows, self.tp = start, rows, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup | None) -> nn.Module:
    return (
        nn.Linear(in_features, out_features, bias=bias)
        if tp is None
        else RowParallelLinear(in_features, out_features, bias, tp)
    )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        """``cfg``: this rank's (``ShardLayout.local_config``; the whole model's without TP)."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = row_linear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
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
        out: torch.Tensor = self.o_proj(ctx.backend.forward(self.layer_id, q, k, v, ctx.fb))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return out


def feed_forward(cfg: ModelConfig, layer_id: int, tp: TPGroup | None) -> nn.Module:
    """Layer ``layer_id``'s MLP: the dense one, or on an MoE model's sparse layers the MoE block
    (model/moe.py), whose shared expert is a dense MLP left without its own all-reduce."""
    moe = cfg.moe
    if moe is None or layer_id not in moe.sparse_layers:
        return MLP(cfg, tp)
    width = moe.shared_intermediate_size
    shared = MLP(replace(cfg, intermediate_size=width, mlp_bias=False)) if width else None
    return SparseMoE(cfg.hidden_size, moe, tp, shared)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, layer_id, tp)

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


LayerFactory = Callable[[ModelConfig, int, "TPGroup | None"], nn.Module]


class Backbone(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layout: ShardLayout,
        tp: TPGroup | None,
        layer: LayerFactory = DecoderLayer,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        """``layer`` / ``norm``: the decoder layer and the final norm (model/hybrid.py passes its own)."""
        super().__init__()
        self.embed_tokens: nn.Module = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            if tp is None
            else VocabParallelEmbedding(layout.vocab_rows, cfg.hidden_size, layout.vocab_start, tp)
        )
        local = layout.local_config(cfg)
        self.layers = nn.ModuleList(layer(local, i, tp) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)


SCORE_SLICE = 512  # prompt positions scored per lm_head call (logprobs of a prompt)


class ModelOutput(NamedTuple):
    """What a forward computes: the logits to sample from, [B, vocab] (every token's with
    ``fb.all_logits``), and the scores of the prompt positions the batch asked about."""

    logits: torch.Tensor
    prompt_scores: PromptScores | None = None


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, tp: TPGroup | None = None) -> None:
        """``cfg``: the whole model's; ``tp``: this rank's group (None: the whole model here)."""
        super().__init__()
        self.config = cfg
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.layout = self.tp.layout if self.tp is not None else ShardLayout.of(cfg)
        self.local_config = self.layout.local_config(cfg)  # this rank's heads: its KV pool's shape
        self.model = self.backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, self.layout.vocab_rows, bias=False)
        self.ops: Ops = TorchOps()
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.init_rope()

    def backbone(self, cfg: ModelConfig) -> Backbone:
        return Backbone(cfg, self.layout, self.tp)

    def init_rope(self) -> None:
        """(Re)build the rotary table (float32 whatever the model's dtype): at init and after loading,
        since building the model on the meta device leaves buffers empty."""
        cfg = self.config
        inv = inv_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        device = next(self.model.embed_tokens.parameters()).device
        if device.type == "meta":
            self.cos_sin = torch.empty(self.max_positions, cfg.rotary_dim, device="meta")
        else:
            self.cos_sin = cos_sin_table(inv.to(device), self.max_positions)

    def output_weight(self) -> torch.Tensor:
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return head.weight  # type: ignore[return-value]  # a Parameter in both

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, backend: AttentionBackend
    ) -> ModelOutput:
        """Each request's last token's logits (every token's with ``fb.all_logits``), and the scores
        of the prompt positions the batch scores (``fb.score_rows``)."""
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
        if fb.score_rows:  # the trailing rows are prompt positions scored for logprobs
            n = x.shape[0] - fb.score_rows
            return ModelOutput(self._logits(x[:n]), self._score_prompt(x[n:], fb))
        return ModelOutput(self._logits(x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.output_weight())
        if self.tp is not None:
            logits = self.tp.all_gather_vocab(logits, self.config.vocab_size)
        return logits.float()

    def _score_prompt(self, x: torch.Tensor, fb: ForwardBatch) -> PromptScores:
        """Each row's log-probability of its target (``fb.score_targets``) and its ``fb.score_top_k``
        most likely (ids, log-probabilities), from the raw logits. In slices: a whole prompt chunk's
        logits at once would be chunk x vocab floats (8,192 x 152k: 5 GB); a slice's are ~0.3 GB.
        Every rank runs it (the logits' all-gather is a collective)."""
        assert fb.score_targets is not None
        chosen, ids, values = [], [], []
        for start in range(0, x.shape[0], SCORE_SLICE):
            lp = torch.log_softmax(self._logits(x[start : start + SCORE_SLICE]), dim=-1)
            targets = fb.score_targets[start : start + SCORE_SLICE]
            chosen.append(lp.gather(1, targets.unsqueeze(1)).squeeze(1))
            best = torch.topk(lp, min(fb.score_top_k, lp.shape[1]), dim=-1)
            ids.append(best.indices)
            values.append(best.values)
        return torch.cat(chosen), torch.cat(ids), torch.cat(values)
