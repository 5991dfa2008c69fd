"""The matmul of an FP8 weight, and which one a device runs.

Two paths, chosen once per model by the device profile (``choose_gemms``, logged there):

* ``scaled_mm``: FP8 x FP8 on the tensor cores through ``torch.nn.functional.scaled_mm`` (torch's
  documented scaled-matmul API; ``torch._scaled_mm`` where a torch predates it), the activations
  quantized per token as the matmul runs:

  - weights scaled per output row (per channel, per tensor, and ``--quantization fp8``): RowWise
    activation x RowWise weight scales. Needs compute capability 8.9+ (Ada, Hopper, Blackwell);
  - 128x128-block weights: BlockWise1x128 activation scales (per token and 128 columns) x
    BlockWise128x128 weight scales. torch runs this recipe on compute capability 9.0 (Hopper) with
    CUDA 12.9+ only (cuBLASLt); elsewhere these weights take the other path;

  both write bfloat16, and need every matrix side a multiple of 16 (blocks: of 128);
* ``dequant``: the weight dequantized to the serving dtype for each matmul, then an ordinary one.
  CPU, GPUs without FP8 tensor cores, and whatever ``scaled_mm`` cannot take here. The memory is
  FP8's; the speed is a little under the unquantized model's (the extra pass over the weight).

A probe call on the device confirms ``scaled_mm`` before the profile picks it: a torch build
without a recipe says so then, not in the middle of serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.scheduler.model.quant.formats import WeightQuant
from radixserve.scheduler.model.quant.fp8 import (
    ScaleLayout,
    dequantize,
    quantize_blocks,
    quantize_rows,
    quantize_token_groups,
    quantize_tokens,
)

if TYPE_CHECKING:
    from radixserve.scheduler.model.config import ModelConfig

SCALED_MM, DEQUANT = "scaled_mm", "dequant"
KERNEL_BLOCK = (128, 128)  # the one block torch's blockwise recipe takes
BLOCKWISE_CUDA = (12, 9)  # cuBLASLt's blockwise scaling


@dataclass(frozen=True, slots=True)
class Fp8Gemms:
    """The GEMM path of FP8 weights scaled per output row, and of those scaled per block."""

    rows: str = DEQUANT
    blocks: str = DEQUANT


def _api() -> str:
    return "torch.nn.functional.scaled_mm" if hasattr(F, "scaled_mm") else "torch._scaled_mm"


def _has_blockwise() -> bool:
    kinds = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and kinds is not None and hasattr(kinds, "BlockWise128x128")


def kernel_scales(scale: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """A 2-D weight's scales as ``scaled_mm`` reads them: ``[1, N]`` per row; per block
    ``[round_up(K/128, 4), N/128]``, column-major (a view of the scales when K/128 is a multiple
    of 4, else a padded copy: 0.02% of the weight's bytes)."""
    if layout.block is None:
        return scale.view(1, -1)
    nb, kb = scale.shape
    padded = -(-kb // 4) * 4
    if padded == kb:
        return scale.t()
    out = scale.new_zeros(nb, padded)
    out[:, :kb] = scale
    return out.t()


def scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, layout: ScaleLayout
) -> torch.Tensor:
    """``x @ weight.T`` on FP8 tensor cores (``scale``: ``kernel_scales``); ``x`` ``[M, K]``."""
    x = x.reshape(-1, weight.shape[1])
    if layout.block is None:
        q, xs = quantize_tokens(x)
        if hasattr(F, "scaled_mm"):
            kind = F.ScalingType.RowWise
            return F.scaled_mm(q, weight.t(), xs, kind, scale, kind, output_dtype=torch.bfloat16)
        return torch._scaled_mm(q, weight.t(), xs, scale, out_dtype=torch.bfloat16)
    q, xs = quantize_token_groups(x, KERNEL_BLOCK[1])
    return F.scaled_mm(
        q, weight.t(), xs, F.ScalingType.BlockWise1x128, scale, F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )  # fmt: skip


def probe_scaled_mm(device: torch.device, layout: ScaleLayout) -> str | None:
    """Why ``scaled_mm`` fails for ``layout`` on ``device`` (None: it runs and agrees with the
    dequantized matmul), from one small call whose rows and column blocks have unequal scales (a
    kernel reading them in another layout gives other numbers)."""
    g = torch.Generator().manual_seed(0)
    w = uneven_weight(g, 256, 256)
    q, scale = quantize_rows(w) if layout.block is None else quantize_blocks(w, layout.block)
    x = torch.randn(16, 256, generator=g).to(torch.bfloat16)
    want = x.float() @ dequantize(q, scale, layout, torch.float32).t()

    def run() -> torch.Tensor:
        return scaled_mm(x.to(device), q.to(device), kernel_scales(scale.to(device), layout), layout)

    return probe_verdict(_api(), run, want)


def uneven_weight(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    """A probe's weight ``[n, k]`` whose rows and 128-column blocks differ in size (so do their
    scales: a kernel that read them in another layout would give other numbers)."""
    uneven = torch.linspace(0.5, 2, n)[:, None] * (1 + 3 * (torch.arange(k) >= 128))
    return torch.randn(n, k, generator=g) * uneven


def probe_verdict(api: str, run: Callable[[], torch.Tensor], want: torch.Tensor) -> str | None:
    """Why the probe call ``run`` of ``api`` fails (None: it runs and is within 5% of the largest of
    ``want``, the dequantized matmul's result: the activations' FP8 rounding, not a wrong layout)."""
    try:
        got = run().float().cpu()
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        return f"{api} failed a probe call: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    err = float((got - want).abs().max() / want.abs().max())
    return None if err < 0.05 else f"{api} was {err:.0%} off the dequantized matmul in a probe call"


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(rows, columns) of the decoder layers' projections (this rank's): qkv, o, gate_up, down, and
    an MoE model's shared expert (its routed experts are quant/grouped.py's)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    shared = cfg.moe.shared_intermediate_size if cfg.moe is not None else 0
    return shapes + ([(2 * shared, hidden), (hidden, shared)] if shared else [])  # Qwen2-MoE's


def device_gemms(
    device: torch.device, dtype: torch.dtype, quant: WeightQuant, shapes: Sequence[tuple[int, int]]
) -> tuple[Fp8Gemms, list[str]]:
    """``choose_gemms`` for this machine's ``device``: its compute capability, torch's CUDA, a probe."""
    if device.type != "cuda":
        return choose_gemms(device, dtype, quant, shapes, None, None, lambda layout: None)
    major, minor = torch.cuda.get_device_capability(device)
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return choose_gemms(
        device, dtype, quant, shapes, (major, minor), (cuda[0], cuda[1]),
        lambda layout: probe_scaled_mm(device, layout),
    )  # fmt: skip


def choose_gemms(
    device: torch.device,
    dtype: torch.dtype,
    quant: WeightQuant,
    shapes: Sequence[tuple[int, int]],
    capability: tuple[int, int] | None,
    cuda_version: tuple[int, int] | None,
    probe: Callable[[ScaleLayout], str | None],
) -> tuple[Fp8Gemms, list[str]]:
    """The paths for a model served in ``dtype`` whose projections are ``shapes`` (N, K) on
    ``device`` of ``capability`` (CUDA; None: CPU); and a line saying what was chosen and why."""
    what = f"FP8 weights ({quant.describe()})"
    if device.type != "cuda" or capability is None:
        return Fp8Gemms(), [f"{what}: dequantized to {str(dtype).removeprefix('torch.')} per matmul on CPU"]
    rows_why = _rows_problem(dtype, shapes, capability) or probe(ScaleLayout())
    block = quant.stored.block if quant.stored is not None else None
    block_why: str | None = None
    if block is not None:
        block_why = (
            rows_why
            or _blocks_problem(block, shapes, capability, cuda_version)
            or probe(ScaleLayout(KERNEL_BLOCK))
        )
    gemms = Fp8Gemms(DEQUANT if rows_why else SCALED_MM, DEQUANT if block_why else SCALED_MM)
    if block is not None:
        path = "" if block_why else f"{_api()} (1x128 activation x 128x128 weight scales)"
        return gemms, [f"{what}: " + (path or f"dequantized to bfloat16 per matmul: {block_why}")]
    path = "" if rows_why else f"{_api()} (per-token activation x per-channel weight scales)"
    return gemms, [
        f"{what}: " + (path or f"dequantized to {str(dtype).removeprefix('torch.')} per matmul: {rows_why}")
    ]


def _rows_problem(
    dtype: torch.dtype, shapes: Sequence[tuple[int, int]], capability: tuple[int, int]
) -> str | None:
    if capability < (8, 9):
        return f"compute capability {capability[0]}.{capability[1]} has no FP8 tensor cores (8.9+ has)"
    if dtype != torch.bfloat16:
        return f"the FP8 GEMM writes bfloat16; this model serves in {str(dtype).removeprefix('torch.')}"
    odd = [s for s in shapes if s[0] % 16 or s[1] % 16]
    return f"projection {odd[0]} is not a multiple of 16 on each side" if odd else None


def _blocks_problem(
    block: tuple[int, int],
    shapes: Sequence[tuple[int, int]],
    capability: tuple[int, int],
    cuda_version: tuple[int, int] | None,
) -> str | None:
    if block != KERNEL_BLOCK:
        return f"torch's blockwise FP8 GEMM takes 128x128 blocks, not {block[0]}x{block[1]}"
    if not _has_blockwise():
        return f"torch {torch.__version__} has no blockwise scaled_mm"
    if capability[0] != 9 or cuda_version is None or cuda_version < BLOCKWISE_CUDA:
        cuda = "?" if cuda_version is None else f"{cuda_version[0]}.{cuda_version[1]}"
        return (
            f"torch's blockwise FP8 GEMM runs on compute capability 9.0 with CUDA 12.9+"
            f" (here {capability[0]}.{capability[1]}, CUDA {cuda})"
        )
    odd = [s for s in shapes if s[0] % 128 or s[1] % 128]
    return f"projection {odd[0]} is not whole 128x128 blocks" if odd else None
