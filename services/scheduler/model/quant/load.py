"""Which projections and experts of a model are FP8 for a checkpoint, and loading their weights and scales.

``plan`` reads the checkpoint's headers (names, dtypes, shapes: no tensor data): a projection whose
checkpoint weights are FP8 is FP8 (layers a tool left in high precision, e.g. llm-compressor's
``ignore`` list, stay so), and so is a mixture-of-experts layer's experts module when its expert
tensors are (per expert or stacked: model/expert_weights.py places them); with ``--quantization
fp8`` every projection (``PROJECTIONS``) and every layer's experts are, the high-precision ones
quantized per output row while loading. It swaps them for ``Fp8Linear`` / ``Fp8Experts`` in the
model built on the meta device, and refuses what cannot be served, naming the tensor: an FP8 tensor
without a quantization_config, outside the decoder layers' linear layers and experts, an FP8 MoE
router (``ROUTERS``: kept in high precision, as the FP8 releases keep it), of another FP8 kind
(e5m2), or without its scales.

``Fp8Loading.load`` takes the tensors that are FP8's business from model/loader.py's loop: the FP8
experts' (expert_load.py), then FP8 weights (copied as they are), high-precision weights of an FP8
projection (quantized on the model's device), scales (checked against their weight's shape, merged
and sliced like it: checkpoint.py) and static ``input_scale`` tensors (skipped: activations are
scaled per token). The loader's own functions place a checkpoint name (``Place``: merged q/k/v,
gate/up; ``ExpertPlace``: an expert's part of its layer's stacks) and slice it for this rank
(``PartOf``, ``Read``); its ``unfilled`` rows track every parameter, scales included, so a scale
missing from the files is reported like a missing weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.llama import RowParallelLinear
from radixserve.scheduler.model.moe import Experts
from radixserve.scheduler.model.quant.checkpoint import (
    ALL,
    E4M3,
    Fp8Plan,
    beside,
    checkpoint_scales,
    fill,
    read_headers,
    scale_part,
    weight_into,
)
from radixserve.scheduler.model.quant.expert_load import ExpertPlace, Fp8ExpertLoading
from radixserve.scheduler.model.quant.formats import SERVED_LINE, block_problem
from radixserve.scheduler.model.quant.fp8 import ScaleLayout
from radixserve.scheduler.model.quant.linear import quantize_experts, quantize_modules

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # what --quantization fp8 quantizes
ROUTERS = ("gate", "shared_expert_gate")  # an MoE block's (model/moe.py): never FP8

Place = Callable[[str], tuple[str, int, int | None]]  # name -> (our parameter, first row, rows; None: all)
PartOf = Callable[[str], tuple[int, int, int] | None]  # name -> this rank's (dim, start, stop); None: all
Read = Callable[[Any, str, tuple[int, int, int] | None], torch.Tensor]  # (file, name, part) -> tensor


def plan(
    model: nn.Module, files: Iterable[Path], cfg: ModelConfig, place: Place, expert_place: ExpertPlace
) -> Fp8Plan | None:
    """Make ``model``'s FP8 projections ``Fp8Linear`` and its FP8 experts ``Fp8Experts`` (it is on
    the meta device, in ``cfg.dtype``); None when the checkpoint has no FP8 weights and none are
    asked for."""
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
    experts: dict[str, ScaleLayout] = {}
    for name in fp8:
        assert fmt is not None
        if headers[name].dtype != E4M3:
            raise ValueError(f"{name}: {headers[name].dtype} weights; FP8 is served as e4m3 ({E4M3})")
        placed = expert_place(name)
        if placed is not None and placed.experts is not None:
            experts[placed.experts] = ScaleLayout(fmt.block)
        else:
            target = placed.param if placed is not None else place(name)[0]
            layouts[_stored_module(name, target, model)] = ScaleLayout(fmt.block)
        scale = beside(name, fmt.scale_suffix)
        if scale not in headers:
            raise ValueError(f"{scale} is missing: the scales of FP8 weight {name} ({fmt.describe()})")
    stored = frozenset(layouts) | frozenset(experts)
    if quant.at_load:
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in PROJECTIONS and name not in layouts:
                layouts[name] = ScaleLayout()
            elif isinstance(module, Experts) and name not in experts:
                experts[name] = ScaleLayout()
    if not layouts and not experts:  # a quantization_config over high-precision weights: nothing is FP8
        return None
    quantize_modules(model, layouts, cfg.dtype)
    quantize_experts(model, experts)
    return Fp8Plan(layouts, experts, stored, quant, headers)


def _stored_module(name: str, target: str, model: nn.Module) -> str:
    """The module FP8 checkpoint tensor ``name`` (our ``target``) is the weight of; ValueError for
    one we cannot serve."""
    if not name.endswith(".weight"):
        raise ValueError(f"unexpected FP8 tensor {name!r}: only linear weights are served in FP8")
    module = target.removesuffix(".weight")
    try:
        found = model.get_submodule(module)
    except AttributeError:
        raise ValueError(f"unexpected tensor {name!r}") from None
    parent, _, leaf = module.rpartition(".")
    if leaf in ROUTERS and parent.endswith(".mlp"):
        raise ValueError(
            f"{name} is FP8: radixserve keeps an MoE router ({leaf}) in high precision, as the FP8"
            " releases store it (its top-k turns on small logit differences); quantize the model"
            " without it (modules_to_not_convert / ignore)"
        )
    if not module.startswith("model.layers.") or not isinstance(found, nn.Linear | RowParallelLinear):
        raise ValueError(
            f"{name} is FP8: radixserve serves FP8 in the decoder layers' linear projections and keeps"
            " the embeddings, the LM head and the rest in the checkpoint's high precision"
        )
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
        expert_place: ExpertPlace,
    ) -> None:
        self.plan, self.params, self.unfilled = plan, params, unfilled
        self.place, self.part_of, self.read = place, part_of, read
        fmt = plan.quant.stored
        self.scale_suffix = fmt.scale_suffix if fmt is not None else None
        self.experts = Fp8ExpertLoading(plan, params, unfilled, expert_place)

    def load(self, f: Any, name: str) -> bool:
        """Load checkpoint tensor ``name`` of open file ``f`` if it is FP8's business; False: it is
        not (the loader's own path loads it)."""
        if self.experts.load(f, name):
            return True
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

    def _weight(
        self, f: Any, name: str, module: str, layout: ScaleLayout, start: int, rows: int | None
    ) -> None:
        n = self.params[module + ".weight"].shape[0] if rows is None else rows
        tensor = self.read(f, name, self.part_of(name))
        index = (slice(start, start + n),)
        target = fill(self.params, self.unfilled, module + ".weight", index, tensor, name, copy=False)
        quantize = module not in self.plan.stored or self.plan.quant.at_load
        scales = weight_into(target, tensor, layout, name, module, quantize)
        if scales is not None:
            self._write_scale(module, layout, start, scales, name)

    def _scale(self, f: Any, name: str, module: str, layout: ScaleLayout, start: int) -> None:
        assert self.scale_suffix is not None
        weight = name.removesuffix(self.scale_suffix) + "weight"
        if weight not in self.plan.headers:
            raise ValueError(f"unexpected tensor {name!r}: no weight {weight} beside it")
        if self.plan.headers[weight].dtype != E4M3:
            return  # a scale beside a high-precision weight: the weight is quantized here, scales and all
        shape, part = self.plan.headers[weight].shape, self.part_of(weight)
        values = checkpoint_scales(name, f.get_tensor(name), shape, layout)
        if part is not None:  # this rank's rows, or (a column split) every row's scale / its blocks
            dim, lo, hi = part
            values = values[scale_part((ALL,) * dim + (slice(lo, hi),), shape, layout)]
        self._write_scale(module, layout, start, values, name)

    def _write_scale(
        self, module: str, layout: ScaleLayout, start: int, values: torch.Tensor, name: str
    ) -> None:
        """The scales of rows ``start..`` of ``module``'s weight (their block rows, per block)."""
        first = start if layout.block is None else start // layout.block[0]
        index = (slice(first, first + values.shape[0]),)
        fill(self.params, self.unfilled, module + ".weight_scale", index, values, name)
