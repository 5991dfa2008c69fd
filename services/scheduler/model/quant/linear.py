"""The layers' FP8 weights: ``Fp8Weight`` (a weight and its scales) and ``Fp8Linear`` (a projection).

``Fp8Weight`` holds ``weight`` (float8_e4m3fn, ``[..., N, K]``) and ``weight_scale`` (float32,
``ScaleLayout``'s shape) as parameters, so the loader fills them by name like any other and the
engine counts their bytes. 2-D for a linear layer; the same container holds a layer's experts
stacked ``[E, N, K]`` (``dequantize`` and the layouts work on any leading dimensions): ``Fp8Experts``
is model/moe.py's ``Experts`` with an ``Fp8Weight`` for each of its two stacks, swapped in by
``quantize_experts`` as ``quantize_modules`` swaps the projections; the MoE op (model/moe_ops.py)
reads it.

``Fp8Linear`` replaces a model's ``nn.Linear`` or ``RowParallelLinear`` (model/llama.py) with the
same ``weight`` / ``bias`` names, ``weight_scale`` beside them: ``quantize_modules`` swaps them in
a model built on the meta device, before it is loaded. Row-parallel (``tp``): the partial sums are
all-reduced, then the bias added, as ``RowParallelLinear`` does. Its GEMM (quant/gemm.py) is set
once by the runner (``use_gemms``) from the device profile; until then it dequantizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.scheduler.model.parallel import TPGroup
from radixserve.scheduler.model.quant.fp8 import FP8, ScaleLayout, dequantize
from radixserve.scheduler.model.quant.gemm import DEQUANT, SCALED_MM, Fp8Gemms, kernel_scales, scaled_mm


class Fp8Weight(nn.Module):
    """An FP8 weight ``[..., N, K]`` and its float32 scales, as stored (never requantized)."""

    def __init__(self, shape: Sequence[int], layout: ScaleLayout) -> None:
        super().__init__()
        self.layout = layout
        self.weight = nn.Parameter(torch.empty(*shape, dtype=FP8), requires_grad=False)
        scales = layout.scale_shape(shape)
        self.weight_scale = nn.Parameter(torch.empty(*scales, dtype=torch.float32), requires_grad=False)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.layout, dtype)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s matrix of a stack ``[E, N, K]``, dequantized: ``[N, K]`` in ``dtype``."""
        return dequantize(self.weight[e], self.weight_scale[e], self.layout, dtype)


class Fp8Experts(nn.Module):
    """One layer's routed experts in FP8: model/moe.py ``Experts``' two stacks as ``Fp8Weight``s
    (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``), one scale layout for both."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, layout: ScaleLayout) -> None:
        super().__init__()
        self.gate_up_proj = Fp8Weight((num_experts, 2 * intermediate, hidden), layout)
        self.down_proj = Fp8Weight((num_experts, hidden, intermediate), layout)


class Fp8Linear(Fp8Weight):
    """``x @ dequantize(W).T + b``, W in FP8; ``tp``: row-parallel (all-reduce, then the bias)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        layout: ScaleLayout,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__((out_features, in_features), layout)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.tp = tp
        self.gemm = DEQUANT
        self.kernel_scale: torch.Tensor | None = None  # the scales as scaled_mm reads them

    def use(self, gemm: str) -> None:
        """Run on ``gemm`` (quant/gemm.py) from now on; called once the weights are loaded."""
        self.gemm = gemm
        self.kernel_scale = kernel_scales(self.weight_scale, self.layout) if gemm == SCALED_MM else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_scale is not None:
            y = scaled_mm(x, self.weight, self.kernel_scale, self.layout).view(*x.shape[:-1], -1)
        else:
            y = F.linear(x, self.dequantize(x.dtype))
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def quantize_modules(model: nn.Module, layouts: Mapping[str, ScaleLayout], dtype: torch.dtype) -> None:
    """Replace each named linear module of ``model`` (built on the meta device) by an
    ``Fp8Linear`` of the same shape, bias and tensor-parallel group; ``dtype``: the bias'."""
    for name, layout in layouts.items():
        old = model.get_submodule(name)
        weight = old.weight
        assert isinstance(weight, torch.Tensor) and weight.dim() == 2, name
        tp = getattr(old, "tp", None)  # RowParallelLinear's group; nn.Linear has none
        with torch.device("meta"):
            new = Fp8Linear(weight.shape[1], weight.shape[0], old.bias is not None, layout, dtype, tp)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)


def quantize_experts(model: nn.Module, layouts: Mapping[str, ScaleLayout]) -> None:
    """Replace each named ``Experts`` module of ``model`` (built on the meta device) by an
    ``Fp8Experts`` of the same shape."""
    for name, layout in layouts.items():
        stack = model.get_submodule(name).gate_up_proj
        assert isinstance(stack, torch.Tensor) and stack.dim() == 3, name
        num, rows, hidden = stack.shape
        with torch.device("meta"):
            new = Fp8Experts(num, hidden, rows // 2, layout)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)


def use_gemms(model: nn.Module, gemms: Fp8Gemms) -> None:
    """Set every FP8 projection of ``model`` on the profile's GEMM for its scale layout."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.use(gemms.blocks if module.layout.block is not None else gemms.rows)
