"""What the two FP8 loaders (projections: load.py; experts: expert_load.py) share about a checkpoint.

* ``Fp8Plan``: which of a model's modules are FP8 for a checkpoint (load.py ``plan`` makes it);
* ``read_headers``: every tensor's dtype and shape, from the safetensors headers (no data read);
* ``checkpoint_scales``: a weight's scales as the checkpoint stores them, checked against the
  weight's shape and put in our layout (``ScaleLayout``): per output row ``[..., N]`` (per-channel
  ``[..., N]`` or ``[..., N, 1]``; one value per tensor, or per expert of a stack, repeated over its
  rows) or per block ``[..., ceil(N/bn), ceil(K/bk)]``;
* ``scale_part`` / ``scale_index``: the part of those scales that goes with a part of the weight
  (a rank's rows or columns, an expert's rows in a stack): rows follow rows, a column split keeps
  every row's scale, blocks follow whole blocks (tensor parallelism splits on whole blocks:
  formats.block_problem);
* ``fill``: a checkpoint tensor into its place in a parameter, its shape checked and its rows
  claimed (model/loader.py's bookkeeping: every row of every parameter is filled exactly once);
* ``weight_into`` / ``quantize_into``: a weight into its FP8 parameter: copied, or (high precision)
  quantized there while loading.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from radixserve.scheduler.model.quant.formats import WeightQuant
from radixserve.scheduler.model.quant.fp8 import FP8, ScaleLayout, quantize_blocks, quantize_rows

E4M3 = "F8_E4M3"  # safetensors' name of float8_e4m3fn
QUANTIZE_ROWS = 4096  # rows quantized at once while loading (temporaries: 10 bytes an element)
ALL = slice(None)
Index = tuple[int | slice, ...]  # a part of a tensor's leading dimensions


@dataclass(frozen=True, slots=True)
class Header:
    dtype: str  # safetensors' dtype name: F8_E4M3, BF16, ...
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Fp8Plan:
    layouts: dict[str, ScaleLayout]  # our FP8 linear module -> what one of its scales covers
    experts: dict[str, ScaleLayout]  # our FP8 experts module (an MoE layer's stacks) -> the same
    stored: frozenset[str]  # the modules (linear or experts) whose checkpoint weights are FP8
    quant: WeightQuant
    headers: dict[str, Header]  # every checkpoint tensor's


def beside(weight: str, kind: str) -> str:
    """The name of the ``kind`` (``weight_scale_inv``, ``weight_scale``, ``input_scale``) beside
    checkpoint weight ``weight``: ``*.weight`` -> ``*.<kind>``; a stacked expert tensor (HF's fused
    name, ``experts.gate_up_proj``) -> ``experts.gate_up_proj_scale_inv`` and the like."""
    if weight.endswith(".weight"):
        return weight.removesuffix("weight") + kind
    return f"{weight}_{kind.removeprefix('weight_')}"


def weight_of(name: str, kind: str) -> str | None:
    """The weight that ``name`` is the ``kind`` beside (``beside``'s inverse); None: it is not one."""
    if name.endswith("." + kind):
        return name.removesuffix(kind) + "weight"
    stacked = "_" + kind.removeprefix("weight_")
    return name.removesuffix(stacked) if name.endswith(stacked) else None


def read_headers(files: Iterable[Path]) -> dict[str, Header]:
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                part = f.get_slice(name)
                out[name] = Header(part.get_dtype(), tuple(part.get_shape()))
    return out


def checkpoint_scales(
    name: str, raw: torch.Tensor, shape: tuple[int, ...], layout: ScaleLayout
) -> torch.Tensor:
    """Checkpoint scales ``name`` of the FP8 weight of ``shape`` ``[..., N, K]``, in ``layout``'s
    shape; ValueError, one line naming ``name``, for scales that fit neither it nor one per tensor."""
    *lead, n, _ = shape
    if layout.block is not None:
        expected = layout.scale_shape(shape)
        if tuple(raw.shape) != expected:
            raise ValueError(
                f"{name}: shape {tuple(raw.shape)}, expected {expected}: one scale per"
                f" {layout.block[0]}x{layout.block[1]} block of the {shape} FP8 weight"
            )
        return raw
    if tuple(raw.shape) in ((*lead, n), (*lead, n, 1)):
        return raw.reshape(*lead, n)
    if raw.numel() == math.prod(lead):  # one per tensor (per expert of a stack)
        return raw.reshape(*lead, 1).expand(*lead, n)
    each = " per expert" if lead else ""
    raise ValueError(
        f"{name}: shape {tuple(raw.shape)}, expected {(*lead, n, 1)}, {(*lead, n)} or one value{each}"
        f" for the {shape} FP8 weight"
    )


def _blocks(part: slice, size: int) -> slice:
    if part == ALL:
        return part
    return slice(part.start // size, -(-part.stop // size))


def scale_part(read: Index, shape: tuple[int, ...], layout: ScaleLayout) -> Index:
    """The part of a weight's scales (``checkpoint_scales``' layout) that goes with its part
    ``read`` (slices of its leading dimensions, the rest whole)."""
    full = tuple(read) + (ALL,) * (len(shape) - len(read))
    *lead, rows, columns = full
    if layout.block is None:
        return (*lead, rows)  # every column of a row shares its scale
    assert isinstance(rows, slice) and isinstance(columns, slice)
    return (*lead, _blocks(rows, layout.block[0]), _blocks(columns, layout.block[1]))


def scale_index(index: Index, layout: ScaleLayout) -> Index:
    """Where in a stacked weight's scales the part ``index`` of the weight puts its own: the same
    rows per row; their block rows per block."""
    if layout.block is None or len(index) < 2:
        return index
    first, rows = index[0], index[1]
    assert isinstance(rows, slice)
    return (first, _blocks(rows, layout.block[0]), *index[2:])


def fill(
    params: Mapping[str, torch.Tensor],
    unfilled: Mapping[str, torch.Tensor],
    param: str,
    index: Index,
    tensor: torch.Tensor,
    name: str,
    *,
    copy: bool = True,
) -> torch.Tensor:
    """Put checkpoint tensor ``name`` (``tensor``: this rank's part of it) at ``params[param][index]``
    in the parameter's dtype (``copy`` False: the caller fills it), once its shape is checked and
    its rows (``unfilled``) claimed; ValueError, naming ``name``, for another shape or rows already
    filled. Returns that place."""
    target = params[param][index]
    if tensor.shape != target.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
    rows = unfilled[param][index]
    if not rows.all():
        at = ", ".join(f"{i.start}:{i.stop}" if isinstance(i, slice) else str(i) for i in index)
        raise ValueError(f"{name}: {param}{f'[{at}]' if at else ''} given twice")
    rows.zero_()
    if copy:
        with torch.no_grad():
            target.copy_(tensor)
    return target


def weight_into(
    target: torch.Tensor, tensor: torch.Tensor, layout: ScaleLayout, name: str, module: str, quantize: bool
) -> torch.Tensor | None:
    """Checkpoint weight ``name``'s part ``tensor`` into FP8 ``target`` (of ``module``): FP8 copied
    as it is (None: its scales come from the checkpoint); high precision quantized there if
    ``quantize`` (its scales returned), else ValueError: the other parts of ``module`` are FP8."""
    if tensor.dtype == FP8:
        with torch.no_grad():
            target.copy_(tensor)
        return None
    if not quantize:
        raise ValueError(
            f"{name} is {str(tensor.dtype).removeprefix('torch.')}, but the other parts of {module}"
            " are FP8 (--quantization fp8 quantizes it at load)"
        )
    return quantize_into(tensor, target, layout)


def quantize_into(tensor: torch.Tensor, target: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """Quantize ``tensor`` ``[..., N, K]`` into FP8 ``target`` on its device (a GPU does it at once),
    one expert and some rows at a time (its float32 temporaries stay small), whole blocks each;
    returns the scales."""
    if tensor.dim() > 2:
        return torch.stack([quantize_into(t, out, layout) for t, out in zip(tensor, target, strict=True)])
    block_rows = 1 if layout.block is None else layout.block[0]
    step = max(QUANTIZE_ROWS // block_rows, 1) * block_rows
    scales = []
    for first in range(0, tensor.shape[0], step):
        rows = tensor[first : first + step].to(target.device)
        q, scale = quantize_rows(rows) if layout.block is None else quantize_blocks(rows, layout.block)
        with torch.no_grad():
            target[first : first + step].copy_(q)
        scales.append(scale)
    return torch.cat(scales)
