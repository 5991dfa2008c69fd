"""Which projections of a model are FP8 for a checkpoint, and loading their weights and scales.

``plan`` reads the checkpoint's headers (names, dtypes, shapes: no tensor data): a projection whose
checkpoint weights are FP8 is FP8 (layers a tool left in high precision, e.g. llm-compressor's
``ignore`` list, stay so); with ``--quantization fp8`` every projection (``PROJECTIONS``) is, the
high-precision ones quantized per output row while loading. It swaps them for ``Fp8Linear`` in the
model built on the meta device, and refuses what cannot be served, naming the tensor: an FP8 tensor
without a quantization_config, outside the decoder layers' linear layers, of another FP8 kind
(e5m2), or without its scales.

``Fp8Loading.load`` takes the tensors that are FP8's business from model/loader.py's loop: FP8
weights (copied as they are), high-precision weights of an FP8 projection (quantized on the model's
device), scales (checked against their weight's shape, merged and sliced like it: per-tensor
scales repeated over their rows, [N, 1] per-channel scales flattened, block scales sliced by whole
blocks) and static ``input_scale`` tensors (skipped: activations are scaled per token). The
loader's own functions place a checkpoint name (``Place``: merged q/k/v, gate/up) and slice it for
this rank (``PartOf``, ``Read``); its ``unfilled`` rows track every parameter, scales included, so
a scale missing from the files is reported like a missing weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.llama import RowParallelLinear
from radixserve.scheduler.model.quant.formats import SERVED_LINE, Fp8Format, WeightQuant, block_problem
from radixserve.scheduler.model.quant.fp8 import FP8, ScaleLayout, quantize_blocks, quantize_rows
from radixserve.scheduler.model.quant.linear import quantize_modules

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # what --quantization fp8 quantizes
QUANTIZE_ROWS = 4096  # rows quantized at once while loading (temporaries: 10 bytes an element)
E4M3 = "F8_E4M3"  # safetensors' name of float8_e4m3fn

Place = Callable[[str], tuple[str, int, int | None]]  # name -> (our parameter, first row, rows; None: all)
PartOf = Callable[[str], tuple[int, int, int] | None]  # name -> this rank's (dim, start, stop); None: all
Read = Callable[[Any, str, tuple[int, int, int] | None], torch.Tensor]  # (file, name, part) -> tensor


@dataclass(frozen=True, slots=True)
class Header:
    dtype: str  # safetensors' dtype name: F8_E4M3, BF16, ...
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Fp8Plan:
    layouts: dict[str, ScaleLayout]  # our FP8 module -> what one of its scales covers
    stored: frozenset[str]  # the modules whose checkpoint weights are FP8
    quant: WeightQuant
    headers: dict[str, Header]  # every checkpoint tensor's


def read_headers(files: Iterable[Path]) -> dict[str, Header]:
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                part = f.get_slice(name)
                out[name] = Header(part.get_dtype(), tuple(part.get_shape()))
    return out


def plan(model: nn.Module, files: Iterable[Path], cfg: ModelConfig, place: Place) -> Fp8Plan | None:
    """Make ``model``'s FP8 projections (it is on the meta device, in ``cfg.dtype``) ``Fp8Linear``;
    None when the checkpoint has no FP8 weights and none are asked for."""
    headers = read_headers(files)
    quant = cfg.quantization
    fmt = quant.stored if quant is not None else None
    fp8 = sorted(name for name, h in headers.items() if h.dtype.startswith("F8"))
    if fp8 and (quant is None or fmt is None):
        raise ValueError(
            f"{fp8[0]} is FP8, but config.json has no quantization_config saying how; {SERVED_LINE}"
        )
    if quant is None:
        return None
    problem = block_problem(cfg, 1)
    if problem is not None:
        raise ValueError(problem)
    layouts: dict[str, ScaleLayout] = {}
    for name in fp8:
        assert fmt is not None
        layouts[_stored_module(name, headers, fmt, model, place)] = ScaleLayout(fmt.block)
    stored = frozenset(layouts)
    if quant.at_load:
        for name, _ in model.named_modules():
            if name.rpartition(".")[2] in PROJECTIONS and name not in layouts:
                layouts[name] = ScaleLayout()
    if not layouts:  # a quantization_config over high-precision weights: nothing is FP8
        return None
    quantize_modules(model, layouts, cfg.dtype)
    return Fp8Plan(layouts, stored, quant, headers)


def _stored_module(
    name: str, headers: Mapping[str, Header], fmt: Fp8Format, model: nn.Module, place: Place
) -> str:
    """The module FP8 checkpoint tensor ``name`` is the weight of; ValueError for one we cannot serve."""
    if headers[name].dtype != E4M3:
        raise ValueError(f"{name}: {headers[name].dtype} weights; FP8 is served as e4m3 ({E4M3})")
    if not name.endswith(".weight"):
        raise ValueError(f"unexpected FP8 tensor {name!r}: only linear weights are served in FP8")
    if ".experts." in name:  # an MoE layer's stacked experts (model/moe.py) hold no FP8 yet
        raise ValueError(f"{name}: FP8 expert weights are not served yet")
    module = place(name)[0].removesuffix(".weight")
    try:
        found = model.get_submodule(module)
    except AttributeError:
        raise ValueError(f"unexpected tensor {name!r}") from None
    if not module.startswith("model.layers.") or not isinstance(found, nn.Linear | RowParallelLinear):
        raise ValueError(
            f"{name} is FP8: radixserve serves FP8 in the decoder layers' linear projections and keeps"
            " the embeddings, the LM head and the rest in the checkpoint's high precision"
        )
    scale = name.removesuffix("weight") + fmt.scale_suffix
    if scale not in headers:
        raise ValueError(f"{scale} is missing: the scales of FP8 weight {name} ({fmt.describe()})")
    return module


class Fp8Loading:
    """Loads the tensors of a checkpoint that are FP8's business into a model ``plan`` shaped."""

    def __init__(
        self,
        plan: Fp8Plan,
        params: Mapping[str, nn.Parameter],
        unfilled: Mapping[str, torch.Tensor],
        place: Place,
        part_of: PartOf,
        read: Read,
    ) -> None:
        self.plan, self.params, self.unfilled = plan, params, unfilled
        self.place, self.part_of, self.read = place, part_of, read
        fmt = plan.quant.stored
        self.scale_suffix = fmt.scale_suffix if fmt is not None else None

    def load(self, f: Any, name: str) -> bool:
        """Load checkpoint tensor ``name`` of open file ``f`` if it is FP8's business; False: it is
        not (the loader's own path loads it)."""
        target, start, rows = self.place(name)
        module, _, kind = target.rpartition(".")
        layout = self.plan.layouts.get(module)
        if layout is None:
            return False
        if kind == "weight":
            self._weight(f, name, module, layout, start, rows)
        elif kind == self.scale_suffix:
            self._scale(f, name, module, layout, start)
        elif kind != "input_scale":  # static activation scales: activations are scaled per token
            return False
        return True

    def _claim(self, param: str, start: int, n: int, name: str) -> None:
        rows = self.unfilled[param][start : start + n]
        if not rows.all():
            raise ValueError(f"{name}: {param} rows {start}.. given twice")
        rows.zero_()

    def _weight(
        self, f: Any, name: str, module: str, layout: ScaleLayout, start: int, rows: int | None
    ) -> None:
        param = self.params[module + ".weight"]
        n = param.shape[0] if rows is None else rows
        tensor = self.read(f, name, self.part_of(name))
        target = param[start : start + n]
        if tensor.shape != target.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        self._claim(module + ".weight", start, n, name)
        with torch.no_grad():
            if tensor.dtype == FP8:
                target.copy_(tensor)
                return
            if module in self.plan.stored and not self.plan.quant.at_load:
                raise ValueError(
                    f"{name} is {str(tensor.dtype).removeprefix('torch.')}, but the other parts of {module}"
                    " are FP8 (--quantization fp8 quantizes it at load)"
                )
        scale = self._quantize(tensor, target, layout)
        first = start if layout.block is None else start // layout.block[0]
        self._write_scale(module, first, scale, name)

    @staticmethod
    def _quantize(tensor: torch.Tensor, target: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
        """Quantize ``tensor`` into ``target`` on its device (a GPU does it at once), some rows at a
        time (its float32 temporaries stay small), whole blocks each; returns the scales."""
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

    def _scale(self, f: Any, name: str, module: str, layout: ScaleLayout, start: int) -> None:
        assert self.scale_suffix is not None
        weight = name.removesuffix(self.scale_suffix) + "weight"
        if weight not in self.plan.headers:
            raise ValueError(f"unexpected tensor {name!r}: no weight {weight} beside it")
        if self.plan.headers[weight].dtype != E4M3:
            return  # a scale beside a high-precision weight: the weight is quantized here, scales and all
        shape, part = self.plan.headers[weight].shape, self.part_of(weight)
        raw = f.get_tensor(name)
        if layout.block is None:
            self._write_scale(module, start, _row_scales(name, raw, shape, part), name)
        else:
            values = _block_scales(name, raw, shape, part, layout.block)
            self._write_scale(module, start // layout.block[0], values, name)

    def _write_scale(self, module: str, first: int, values: torch.Tensor, name: str) -> None:
        param = self.params[module + ".weight_scale"]
        target = param[first : first + values.shape[0]]
        if values.shape != target.shape:
            raise ValueError(f"{name}: scales of shape {tuple(values.shape)} for {tuple(target.shape)}")
        self._claim(module + ".weight_scale", first, values.shape[0], name)
        with torch.no_grad():
            target.copy_(values)


def _row_scales(
    name: str, raw: torch.Tensor, shape: tuple[int, ...], part: tuple[int, int, int] | None
) -> torch.Tensor:
    """A weight's scales per output row from one per tensor, or one per channel ([N] or [N, 1]);
    this rank's rows of them (a column split keeps every row)."""
    n = shape[0]
    if raw.numel() == 1:
        rows = raw.reshape(1).expand(n)
    elif tuple(raw.shape) in ((n,), (n, 1)):
        rows = raw.reshape(n)
    else:
        raise ValueError(
            f"{name}: shape {tuple(raw.shape)}, expected ({n}, 1), ({n},) or one value for the"
            f" {shape} FP8 weight"
        )
    return rows if part is None or part[0] != 0 else rows[part[1] : part[2]]


def _block_scales(
    name: str,
    raw: torch.Tensor,
    shape: tuple[int, ...],
    part: tuple[int, int, int] | None,
    block: tuple[int, int],
) -> torch.Tensor:
    """A weight's block scales, checked against its shape; this rank's whole blocks of them."""
    expected = tuple(-(-d // b) for d, b in zip(shape, block, strict=True))
    if tuple(raw.shape) != expected:
        raise ValueError(
            f"{name}: shape {tuple(raw.shape)}, expected {expected}: one scale per {block[0]}x{block[1]}"
            f" block of the {shape} FP8 weight"
        )
    if part is None:
        return raw
    dim, start, stop = part
    size = block[dim]  # model/parallel.py splits on whole blocks (formats.block_problem)
    return raw.narrow(dim, start // size, -(-stop // size) - start // size)
