"""FP8 (e4m3) numbers: quantize and dequantize weights and activations.

A weight ``[..., N, K]`` (a linear layer's ``[N, K]``, or a layer's stacked experts ``[E, N, K]``)
stands for ``weight * scale``, with float32 scales laid out as ``ScaleLayout`` says:

* per output row: ``[..., N]``. A checkpoint's per-channel scales are these; its per-tensor scale
  is repeated over the rows of that tensor, so q, k and v, each with its own scale, merge into one
  ``qkv_proj`` without requantizing anything;
* per block: ``[..., ceil(N / bn), ceil(K / bk)]`` (the official FP8 checkpoints' 128x128 blocks).

Activations are quantized when a matmul runs: one scale per token (row of ``x``), or per token and
group of 128 columns for the block GEMM. The largest magnitude of each maps to FP8's largest
(448), so nothing overflows and nothing saturates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
# An all-zero row or block still gets a positive scale: it dequantizes to zeros, never NaN.
MIN_SCALE = 1e-12


@dataclass(frozen=True, slots=True)
class ScaleLayout:
    """What one scale covers: a block of (rows, columns), or (None) one output row."""

    block: tuple[int, int] | None = None

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The scales' shape for a weight of ``shape`` ``[..., N, K]``."""
        *lead, n, k = shape
        if self.block is None:
            return (*lead, n)
        bn, bk = self.block
        return (*lead, -(-n // bn), -(-k // bk))


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., N, K]`` -> (FP8 weight, float32 scales ``[..., N]``): one scale per output row."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    return (w32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., N, K]`` -> (FP8 weight, float32 scales ``[..., ceil(N/bn), ceil(K/bk)]``); a
    partial last block's scale covers the rows and columns it has."""
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    blocks = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(*lead, nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale


def expand_scales(scale: torch.Tensor, layout: ScaleLayout, shape: Sequence[int]) -> torch.Tensor:
    """The scales broadcast against a weight of ``shape``: ``[..., N, 1]`` or ``[..., N, K]``."""
    if layout.block is None:
        return scale.unsqueeze(-1)
    n, k = shape[-2], shape[-1]
    rows = scale.repeat_interleave(layout.block[0], dim=-2).narrow(-2, 0, n)
    return rows.repeat_interleave(layout.block[1], dim=-1).narrow(-1, 0, k)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, layout: ScaleLayout, dtype: torch.dtype
) -> torch.Tensor:
    """The weight in ``dtype``: the product in float32, rounded once (what a reference that
    dequantizes the checkpoint in float32 and casts computes)."""
    return (weight.float() * expand_scales(scale, layout, weight.shape)).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> (FP8 ``[M, K]``, float32 scales ``[M, 1]``): one scale per token."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    return (x / scale).to(FP8), scale


def quantize_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (K a multiple of ``group``) -> (FP8 ``[M, K]``, float32 scales
    ``[M, K / group]``): one scale per token and ``group`` columns, column-major as the blockwise
    GEMM reads them (reduced from the groups taken group-major, so no copy lays them out)."""
    m, k = x.shape
    groups = x.reshape(m, k // group, group)
    amax = torch.linalg.vector_norm(groups.transpose(0, 1), ord=float("inf"), dim=-1, dtype=torch.float32)
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE).t()  # [K / group, M] contiguous -> [M, K / group]
    return (groups / scale.unsqueeze(-1)).to(FP8).view(m, k), scale
