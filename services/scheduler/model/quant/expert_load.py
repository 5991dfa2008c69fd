"""FP8 experts at load: each expert tensor's weight and scales into its part of the layer's stacks.

A mixture-of-experts layer whose checkpoint experts are FP8 (or, with ``--quantization fp8``, any
layer's) holds ``Fp8Experts`` (quant/linear.py): ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]``, each an ``Fp8Weight`` with its scales in the checkpoint's layout (per output row, or
per 128x128 block). model/expert_weights.py places every expert tensor as it does for
high-precision experts (``Placement``: our stack, the expert's rows in it, this rank's part of the
tensor); here

* an FP8 weight is copied there as it is;
* its scales (``*.weight_scale_inv`` / ``*.weight_scale`` beside a per-expert ``*.weight``;
  ``experts.gate_up_proj_scale_inv`` and the like beside a stacked tensor) are checked against the
  weight's shape, put in our layout and sliced for this rank as the weight is (checkpoint.py), then
  copied to the same expert's rows (per row) or block rows (per block) of the stack's scales;
* a high-precision weight of an FP8 stack is quantized there (``--quantization fp8``: per row, one
  expert at a time; a block checkpoint's odd high-precision part: into the stack's blocks), else
  refused as a part that does not match the others;
* static ``input_scale`` tensors are skipped (activations are scaled per token).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from radixserve.scheduler.model.expert_weights import Placement
from radixserve.scheduler.model.quant.checkpoint import (
    E4M3,
    Fp8Plan,
    checkpoint_scales,
    fill,
    scale_index,
    scale_part,
    weight_into,
    weight_of,
)
from radixserve.scheduler.model.quant.fp8 import ScaleLayout

ExpertPlace = Callable[[str], Placement | None]  # name -> its place in an MoE layer; None: not an MoE tensor


class Fp8ExpertLoading:
    """Loads the checkpoint tensors of the FP8 experts ``plan`` found (``plan.experts``)."""

    def __init__(
        self,
        plan: Fp8Plan,
        params: Mapping[str, nn.Parameter],
        unfilled: Mapping[str, torch.Tensor],
        place: ExpertPlace,
    ) -> None:
        self.plan, self.params, self.unfilled, self.place = plan, params, unfilled, place
        fmt = plan.quant.stored
        self.kinds = ("input_scale",) if fmt is None else (fmt.scale_suffix, "input_scale")

    def load(self, f: Any, name: str) -> bool:
        """Load checkpoint tensor ``name`` of open file ``f`` if it is an FP8 expert's (weight,
        scales, input scale); False: it is not."""
        found = self._find(name)
        if found is None:
            return False
        weight, kind, placed = found
        layout = self.plan.experts[str(placed.experts)]
        if kind == "weight":
            self._weight(f, name, placed, layout)
        elif kind != "input_scale" and self.plan.headers[weight].dtype == E4M3:
            self._scale(f, name, self.plan.headers[weight].shape, placed, layout)
        # else: a static input scale, or a scale beside a high-precision weight (quantized here)
        return True

    def _find(self, name: str) -> tuple[str, str, Placement] | None:
        """(the expert weight ``name`` is or stands beside, which of its tensors ``name`` is:
        ``weight`` or a kind, its placement) for a tensor of an FP8 experts module; else None."""
        candidates = [(name, "weight")] + [(weight_of(name, kind), kind) for kind in self.kinds]
        for weight, kind in candidates:
            placed = None if weight is None else self.place(weight)
            if weight is None or placed is None or placed.experts not in self.plan.experts:
                continue
            if weight not in self.plan.headers:
                raise ValueError(f"unexpected tensor {name!r}: no weight {weight} beside it")
            return weight, kind, placed
        return None

    def _weight(self, f: Any, name: str, placed: Placement, layout: ScaleLayout) -> None:
        tensor = placed.read(name, f.get_slice(name))
        param = placed.param + ".weight"
        target = fill(self.params, self.unfilled, param, placed.index, tensor, name, copy=False)
        experts = str(placed.experts)
        quantize = experts not in self.plan.stored or self.plan.quant.at_load
        scales = weight_into(target, tensor, layout, name, experts, quantize)
        if scales is not None:
            self._write_scale(placed, layout, scales, name)

    def _scale(
        self, f: Any, name: str, shape: tuple[int, ...], placed: Placement, layout: ScaleLayout
    ) -> None:
        """Scales ``name`` of the FP8 weight of ``shape`` that ``placed`` places: this rank's part
        of them (the weight's parts, concatenated as it concatenates them)."""
        scales = checkpoint_scales(name, f.get_tensor(name), shape, layout)
        parts = [scales[scale_part(read, shape, layout)] for read in placed.reads]
        values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=placed.cat_dim)
        self._write_scale(placed, layout, values, name)

    def _write_scale(self, placed: Placement, layout: ScaleLayout, values: torch.Tensor, name: str) -> None:
        index = scale_index(placed.index, layout)
        fill(self.params, self.unfilled, placed.param + ".weight_scale", index, values, name)
