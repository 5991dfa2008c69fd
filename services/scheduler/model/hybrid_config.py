"""HybridConfig: what a hybrid checkpoint (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) adds to a decoder.

Three of every four layers of these models are Gated DeltaNet "linear attention" layers (a
recurrent state and a short causal convolution instead of a KV cache), the rest gated full
attention over the paged KV pool. ``layer_types`` in config.json says which layer is which; the
linear layers' shapes come from ``linear_num_key_heads`` / ``linear_num_value_heads`` /
``linear_key_head_dim`` / ``linear_value_head_dim`` / ``linear_conv_kernel_dim``.

The full-attention layers of these models differ from Qwen3's in three ways this config records:
the query projection also produces an output gate (``q_proj`` is twice as wide), RoPE turns only
the first ``rotary_dim`` features of each head (``partial_rotary_factor``), and every RMSNorm but
the linear layers' gated one stores its weight as ``w - 1`` (the norms compute ``x * (1 + w)``).

What cannot be served is refused here, in one line: a ``layer_types`` list of the wrong length or
with a kind we do not know, value heads that are not a multiple of key heads, no full-attention
layer at all (nothing for the KV pool and prefix cache to hold).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from radixserve.scheduler.memory.state_pool import StateShape

HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class HybridConfig:
    layer_types: tuple[str, ...]  # per layer: LINEAR or FULL
    num_k_heads: int  # linear layers' query/key heads (this rank's under tensor parallelism)
    num_v_heads: int  # linear layers' value heads (a multiple of the key heads)
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # the causal convolution's width
    rotary_dim: int  # features of each full-attention head that RoPE turns
    interleaved_qkvz: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_rows(self) -> int:
        """Rows of our merged input projection: q, k, v, z (the output gate), b (beta), a (decay)."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    def state_shape(self) -> StateShape:
        """One request's recurrent state (every linear layer's) as the state pool holds it."""
        return StateShape(
            len(self.linear_layers),
            self.conv_dim,
            self.conv_kernel - 1,
            self.num_v_heads,
            self.k_head_dim,
            self.v_head_dim,
        )

    def tp_problem(self, size: int) -> str | None:
        """Why the linear layers cannot be split ``size`` ways (None: they can)."""
        if self.num_k_heads % size:
            return f"tp_size {size} does not divide the linear layers' {self.num_k_heads} key heads"
        if self.num_v_heads % size:
            return f"tp_size {size} does not divide the linear layers' {self.num_v_heads} value heads"
        return None

    def split(self, size: int) -> HybridConfig:
        """One rank's share: its key and value heads (a value head stays with its key head)."""
        return replace(self, num_k_heads=self.num_k_heads // size, num_v_heads=self.num_v_heads // size)


def hybrid_config(hf: Any, arch: str, num_layers: int, head_dim: int) -> HybridConfig | None:
    """The hybrid part of HF config ``hf`` (None: not a hybrid architecture)."""
    if arch not in HYBRID_ARCHS:
        return None
    types = tuple(getattr(hf, "layer_types", None) or ())
    if len(types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted({t for t in types if t not in (LINEAR, FULL)})
    if unknown:
        raise ValueError(f"config.json: layer_types {unknown} not served; expected {LINEAR} or {FULL}")
    if FULL not in types:
        raise ValueError("config.json: layer_types has no full_attention layer")
    nk, nv = int(hf.linear_num_key_heads), int(hf.linear_num_value_heads)
    if nk < 1 or nv % nk:
        raise ValueError(
            f"config.json: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}"
        )
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    factor = float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise ValueError(f"config.json: partial_rotary_factor {factor} gives {rotary} rotary features")
    return HybridConfig(
        layer_types=types,
        num_k_heads=nk,
        num_v_heads=nv,
        k_head_dim=int(hf.linear_key_head_dim),
        v_head_dim=int(hf.linear_value_head_dim),
        conv_kernel=int(hf.linear_conv_kernel_dim),
        rotary_dim=rotary,
        interleaved_qkvz=arch == "qwen3_next",
    )
