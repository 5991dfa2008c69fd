"""Mixture-of-experts checkpoints rewritten as other tools write them (tests/unit/test_loader.py,
test_fp8_moe.py).

``stack_experts``: transformers 5 saves each expert's matrices apart (``mlp.experts.{e}.gate_proj``,
...); HF's fused layout, which some checkpoints store, stacks them per layer: ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (gate rows, then up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``. An FP8
checkpoint's scales stack beside them under HF's names (``gate_up_proj_scale_inv``,
``down_proj_scale``): block and per-channel scales as the weights do; a per-tensor scale per expert
for down (``[E]``), repeated over its rows for gate/up (gate and up each have their own); static
input scales are dropped.
"""

from __future__ import annotations

import torch

PROJS = ("gate_proj", "up_proj", "down_proj")


def _rows(scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A gate or up scale as rows of the merged gate_up: one per tensor repeated over its rows."""
    return scale.reshape(1, 1).expand(weight.shape[0], 1) if scale.numel() == 1 else scale


def stack_experts(tensors: dict[str, torch.Tensor], experts: int = 4) -> None:
    """``tensors``' Qwen per-expert tensors, in place, -> HF's fused layout (the module's docstring)."""
    layers = sorted({n.split(".mlp.experts.")[0] for n in tensors if ".mlp.experts." in n})
    kinds = sorted(
        {n.rpartition(".")[2] for n in tensors if ".mlp.experts." in n}, key=lambda k: k != "weight"
    )
    for layer in layers:
        stack = f"{layer}.mlp.experts."
        weights: dict[str, list[torch.Tensor]] = {}
        for kind in kinds:  # the weights first: a per-tensor scale takes their rows
            each = {p: [tensors.pop(f"{stack}{e}.{p}.{kind}") for e in range(experts)] for p in PROJS}
            if kind == "input_scale":
                continue
            suffix = "" if kind == "weight" else "_" + kind.removeprefix("weight_")
            if kind == "weight":
                weights = each
                gate_up = [torch.cat(pair) for pair in zip(each["gate_proj"], each["up_proj"], strict=True)]
            else:
                parts = zip(
                    each["gate_proj"], each["up_proj"], weights["gate_proj"], weights["up_proj"], strict=True
                )
                gate_up = [torch.cat([_rows(g, gw), _rows(u, uw)]) for g, u, gw, uw in parts]
            tensors[f"{stack}gate_up_proj{suffix}"] = torch.stack(gate_up)
            tensors[f"{stack}down_proj{suffix}"] = torch.stack(each["down_proj"])
