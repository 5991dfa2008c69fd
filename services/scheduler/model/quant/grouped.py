"""FP8 experts' matmuls, and which one a device runs (the device profile asks ``choose_experts``).

A mixture-of-experts layer with FP8 experts (``Fp8Experts``: two stacked ``Fp8Weight``s) runs on
one of two paths of the MoE op (model/moe_ops.py), the profile's choice, logged in its notes:

* ``scaled_grouped_mm``: each projection of every expert as one FP8 x FP8 grouped GEMM on the
  tensor cores, through ``torch.nn.functional.scaled_grouped_mm`` (torch's documented API;
  ``torch._scaled_grouped_mm`` where a torch predates it): the rows sorted by expert (the MoE op
  does that), quantized per row as the GEMM runs, RowWise activation x RowWise weight scales, group
  ends found on the device. Nothing is read back on the host, so decode graphs capture it. torch
  builds this kernel for compute capability 9.0 (Hopper) and weights scaled per output row (per
  channel, per tensor, ``--quantization fp8``); it writes bfloat16 and wants 16-byte-aligned rows;
* the torch reference (``torch``): for each expert that has rows this step, its weights
  dequantized to the serving dtype, then the ordinary matmul pair. Only the experts routed to are
  dequantized, one at a time, so the resident memory stays FP8's and the temporary is one expert's
  matrices. It reads the per-expert row counts on the host: no decode graphs where it runs.
  Everywhere else: CPU, other GPUs, 128x128-block experts (torch has no blockwise grouped GEMM).

A probe call on the device confirms ``scaled_grouped_mm`` before the profile picks it (groups of
unequal sizes, one empty; rows of unequal scales), as quant/gemm.py's probe does for ``scaled_mm``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from radixserve.scheduler.model.quant.formats import WeightQuant
from radixserve.scheduler.model.quant.fp8 import ScaleLayout, dequantize, quantize_rows, quantize_tokens
from radixserve.scheduler.model.quant.gemm import probe_verdict, uneven_weight

SCALED_GROUPED = "scaled_grouped_mm"  # the MoE op's name of this path (model/moe_ops.py EXPERTS)


def api() -> str:
    return (
        "torch.nn.functional.scaled_grouped_mm"
        if hasattr(F, "scaled_grouped_mm")
        else "torch._scaled_grouped_mm"
    )


def scaled_grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """Each row of ``x`` ``[M, K]`` times its expert's FP8 ``weight`` ``[E, N, K]`` (scales
    ``[E, N]``, one per output row), transposed: rows ``ends[e-1]:ends[e]`` (int32, on the device)
    are expert e's. ``[M, N]`` in bfloat16, ``x`` quantized per row on the way."""
    q, x_scale = quantize_tokens(x)
    # [E, N, K] transposed is the column-major [E, K, N] operand the kernel wants, without a copy
    w = weight.transpose(1, 2)
    if hasattr(F, "scaled_grouped_mm"):
        rows = F.ScalingType.RowWise
        out: torch.Tensor = F.scaled_grouped_mm(
            q, w, x_scale.view(-1), rows, scale, rows, offs=ends, output_dtype=torch.bfloat16
        )
        return out
    return torch._scaled_grouped_mm(q, w, x_scale.view(-1), scale, offs=ends, out_dtype=torch.bfloat16)


def probe_scaled_grouped_mm(device: torch.device) -> str | None:
    """Why ``scaled_grouped_mm`` fails on ``device`` (None: it runs and agrees with the dequantized
    matmuls), from one small call of three experts whose groups have 5, 0 and 11 rows."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([5, 0, 11])
    w = torch.stack([uneven_weight(g, 128, 256) * (e + 1) for e in range(len(sizes))])
    q, scale = quantize_rows(w)
    x = torch.randn(int(sizes.sum()), 256, generator=g).to(torch.bfloat16)
    expert = torch.repeat_interleave(torch.arange(len(sizes)), sizes)  # each row's
    weights = dequantize(q, scale, ScaleLayout(), torch.float32)[expert]
    want = torch.bmm(weights, x.float().unsqueeze(-1)).squeeze(-1)
    ends = sizes.cumsum(0).to(torch.int32)

    def run() -> torch.Tensor:
        return scaled_grouped_mm(x.to(device), q.to(device), scale.to(device), ends.to(device))

    return probe_verdict(api(), run, want)


def unsupported(
    device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None, widths: Sequence[int]
) -> str | None:
    """Why ``scaled_grouped_mm`` cannot run here (None: it may; the probe has the last word).
    ``widths``: the hidden size and the experts' (this rank's) width."""
    if device.type != "cuda" or capability is None:
        return "FP8 grouped GEMM kernels need a CUDA device"
    if not hasattr(F, "scaled_grouped_mm") and not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no scaled_grouped_mm"
    if dtype != torch.bfloat16:
        return (
            f"the FP8 grouped GEMM writes bfloat16; this model serves in {str(dtype).removeprefix('torch.')}"
        )
    if capability[0] != 9:
        return f"torch's FP8 grouped GEMM is built for SM90, not SM{capability[0]}{capability[1]}"
    if any(w % 16 for w in widths):
        odd = tuple(widths)
        return f"FP8 grouped GEMM rows must be 16-byte aligned: widths {odd} are not all multiples of 16"
    return None


def choose_experts(
    device: torch.device,
    dtype: torch.dtype,
    quant: WeightQuant,
    widths: Sequence[int],
    capability: tuple[int, int] | None,
    probe: Callable[[], str | None],
) -> tuple[str, str]:
    """The MoE op's path for FP8 experts (``scaled_grouped_mm`` or ``torch``) on ``device`` of
    ``capability`` (CUDA; None: CPU), and the line that says what was chosen and why."""
    block = quant.stored.block if quant.stored is not None else None
    what = f"MoE experts in FP8 ({f'{block[0]}x{block[1]} blocks' if block else 'per output row'})"
    why = unsupported(device, dtype, capability, widths)
    if why is None:
        why = "torch has no blockwise FP8 grouped GEMM" if block is not None else probe()
    if why is None:
        return SCALED_GROUPED, f"{what}: {api()} (per-token x per-row scales), CUDA-graph safe"
    dequant = f"each routed expert dequantized to {str(dtype).removeprefix('torch.')} per matmul"
    return "torch", f"{what}: the torch reference, {dequant} ({why})"
