"""The model's elementwise and normalisation ops, one implementation per device kind.

The layer code (model/llama.py, model/moe.py) calls these six ops and nothing else between its
matmuls and attention, so one model file serves both devices:

* ``TorchOps``: plain torch, every device. The reference: numerically what Hugging Face computes
  (RMSNorm in fp32 then cast, the residual added in the model's dtype, rotate-half RoPE with
  cos/sin cast to the model's dtype). On CPU these few ops per layer are cheap next to the matmuls.
* ``FlashInferOps``: flashinfer's fused CUDA kernels: RMSNorm (also per head, for Qwen3's q/k norm,
  straight from the strided q/k views of the merged qkv output), add + RMSNorm in place, RoPE in
  place from a float32 cos/sin table, SiLU-and-multiply. One kernel each, where torch launches 4-8.

Contracts (both classes):

* ``rms_norm(x, w, eps)``: x ``[T, D]`` or ``[T, H, D]`` (last dim contiguous) -> new tensor.
* ``add_rms_norm(x, residual, w, eps)`` -> ``(rms_norm(residual + x), residual + x)``; may reuse
  ``x`` and ``residual``'s storage (flashinfer works in place): callers own both.
* ``silu_and_mul(x)``: ``[T, 2I]`` -> ``silu(x[:, :I]) * x[:, I:]``.
* ``rms_norm_offset`` / ``add_rms_norm_offset``: the two norms above with the weight stored as
  ``w - 1`` (Qwen3-Next and Qwen3.5's norms: ``norm(x) * (1 + w)``; flashinfer's Gemma RMSNorm).
* ``rope_inputs(positions, cos_sin)`` once per forward, then ``rope(q, k, inputs)`` per layer on
  q ``[T, H, D]`` and k ``[T, Hkv, D]`` (neox / rotate-half layout); returns the rotated pair,
  which may be q and k themselves. A table narrower than the head turns only its first features
  (partial rotary: the hybrids' ``partial_rotary_factor``).

* ``moe(x, router_logits, gate_up, down, top_k, renormalize)``: a mixture-of-experts block's
  routed experts, ``[T, H]`` -> ``[T, H]`` (model/moe_ops.py has the contract). Routing is the same
  torch code in both classes; the experts run through the implementation the device profile chose
  (``make_ops``' ``moe``: the torch reference, ``grouped_mm`` on GPUs with grouped GEMM kernels,
  or ``scaled_grouped_mm`` for FP8 experts on GPUs with FP8 grouped GEMM kernels); the stacks are
  tensors, or FP8 ``Fp8Weight``s.

``cos_sin`` is ``[max_positions, D]`` float32: cos of each position's angles in the first half,
sin in the second (flashinfer's layout; the torch path reads the same table).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F

from radixserve.scheduler.model.moe_ops import EXPERTS, Stack, route

# What rope_inputs computes once per forward for rope to use in every layer: (cos, sin) rows for
# the torch path, (positions, the cos/sin table) for flashinfer's kernel.
RopeInputs = tuple[torch.Tensor, torch.Tensor]


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: cos then sin of ``position * inv_freq``."""
    t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())  # the product HF computes per position
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.shape[-1] < x.shape[-1]:  # partial rotary (the hybrids): the other features pass through
        rot = cos.shape[-1]
        return torch.cat([_rotate(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class MoEOp:
    """``moe``, shared by both op sets: the experts' implementation is the profile's choice."""

    def __init__(self, moe: str = "torch") -> None:
        if moe not in EXPERTS:
            raise ValueError(f"unknown MoE experts {moe!r}; choose {' or '.join(EXPERTS)}")
        self.moe_experts = moe
        self._experts = EXPERTS[moe]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        gate_up: Stack,
        down: Stack,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        return self._experts(x, route(router_logits, top_k, renormalize), gate_up, down, self.silu_and_mul)


class TorchOps(MoEOp):
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rms_norm_offset(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm whose weight is stored as ``w - 1`` (the hybrids' norms): ``norm(x) * (1 + w)``, the
        product taken in float32 before the cast, as HF computes it."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * (1.0 + weight.float())).to(x.dtype)

    def add_rms_norm_offset(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm_offset(residual, weight, eps), residual

    def rope_inputs(self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        half = cos_sin.shape[-1] // 2
        cs = cos_sin.index_select(0, positions)
        cos, sin = cs[:, :half], cs[:, half:]
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)

    def rope(self, q: torch.Tensor, k: torch.Tensor, inputs: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = inputs
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class FlashInferOps(MoEOp):
    """flashinfer's fused kernels (CUDA, fp16/bf16). ``flashinfer`` may be injected: the CPU tests
    count this class's launches with a stand-in module, since the real kernels need a GPU."""

    name = "flashinfer"

    def __init__(self, flashinfer: ModuleType | None = None, moe: str = "torch") -> None:
        super().__init__(moe)
        self.fi = flashinfer if flashinfer is not None else importlib.import_module("flashinfer")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # 3-D input is flashinfer's per-head (QK) RMSNorm; it reads strided rows, writes a new tensor.
        out: torch.Tensor = self.fi.norm.rmsnorm(x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.fi.norm.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fi.activation.silu_and_mul(x)
        return out

    def rms_norm_offset(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # flashinfer's Gemma RMSNorm computes norm(x) * (1 + w); it takes rows, so heads are flattened
        out: torch.Tensor = self.fi.norm.gemma_rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps)
        return out.view(x.shape)

    def add_rms_norm_offset(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.fi.norm.gemma_fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def rope_inputs(self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        return positions, cos_sin

    def rope(self, q: torch.Tensor, k: torch.Tensor, inputs: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        positions, cos_sin = inputs
        t, head_dim = q.shape[0], q.shape[-1]
        # [T, H, D] views whose rows may be strided (slices of the qkv output) flatten to [T, H * D].
        self.fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.view(t, -1), k.view(t, -1), head_dim, cos_sin, is_neox=True
        )
        return q, k


Ops = TorchOps | FlashInferOps  # the two implementations of the contracts above


def make_ops(name: str, flashinfer: ModuleType | None = None, moe: str = "torch") -> Ops:
    """``moe``: the MoE experts' implementation (model/moe_ops.py ``EXPERTS``)."""
    if name == "torch":
        return TorchOps(moe)
    if name == "flashinfer":
        return FlashInferOps(flashinfer, moe)
    raise ValueError(f"unknown ops {name!r}; choose torch or flashinfer")
